"""A run checks the functions its config names before its first cache key, which calls the user's data function to
hash its data: a typo fails at once in a workdir of earlier runs as in a new one. And a cached rerun whose check was
mostly that call says so without -v, naming data.skip_unchanged."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

from kiln.pipeline.config import config_from_dict
from kiln.pipeline.runner import Runner, StageRecord, check_user_code
from kiln.pipeline.stage_list import STAGES
from kiln.pipeline.user_code import defined_unrun
from tests.conftest import tiny_config_dict

PROJECT = """
from pathlib import Path

import torch

from kiln import DatasetSplits


def load():
    calls = Path(__file__).with_name("calls.txt")
    calls.write_text(calls.read_text() + "x" if calls.exists() else "x")
    x, y = torch.zeros(8, 1, 8, 8), torch.zeros(8, dtype=torch.long)
    return DatasetSplits(x, y, x, y, num_classes=10)


def score(outputs, labels):
    return 1.0
"""


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "slowproj.py").write_text(PROJECT)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "slowproj", raising=False)
    return tmp_path


def test_a_misspelt_metric_fails_before_the_data_function_is_called(project: Path) -> None:
    cfg = config_from_dict(tiny_config_dict(**{"data.name": "slowproj:load", "validate.metric": "slowproj:scroe"}))
    result = Runner(cfg, project / "wd", STAGES).run()
    assert "'scroe' in module 'slowproj' is not defined" in str(result.error), result.error
    assert result.error is not None and result.error.hint.startswith("write 'slowproj:score'")
    assert not (project / "calls.txt").exists()  # the data function was never called
    assert result.records[0].status == "failed" and not (project / "wd" / "train").exists()


def test_a_module_the_source_cannot_tell_of_is_not_imported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A package re-exporting with ``import *``: its names are not in its source, and importing it on a run whose
    stages are cached would load what it imports (torch): left to the stages' own checks."""
    (tmp_path / "starpkg").mkdir()
    (tmp_path / "starpkg" / "__init__.py").write_text("from starpkg.impl import *\n")
    (tmp_path / "starpkg" / "impl.py").write_text("def score(outputs, labels):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = config_from_dict(tiny_config_dict(**{"validate.metric": "starpkg:score"}))
    check_user_code(cfg, ["validate"])
    assert "starpkg" not in sys.modules


def test_functions_found_in_the_source_import_nothing(project: Path) -> None:
    cfg = config_from_dict(tiny_config_dict(**{"data.name": "slowproj:load", "validate.metric": "slowproj:score"}))
    check_user_code(cfg, ["data", "validate"])
    assert "slowproj" not in sys.modules  # a cached run stays free of the user's imports


@pytest.mark.parametrize(
    ("source", "found"),
    [
        ("def f(): pass\n", True),
        ("try:\n    from os import path as f\nexcept ImportError:\n    f = None\n", True),
        ("if True:\n    class f: pass\n", True),
        ("def g():\n    f = 1\n", False),  # a local name, not the module's
        ("from os.path import *\n", None),  # cannot be told without running: left to the stages' own checks
        ("def __getattr__(name): ...\n", None),
        ("def f(:\n", False),  # the import names the line
    ],
)
def test_defined_unrun_reads_the_top_level_of_the_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, found: bool | None
) -> None:
    (tmp_path / "unrunmod.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "unrunmod", raising=False)
    assert defined_unrun("unrunmod", "f") is found
    assert "unrunmod" not in sys.modules


def _said(caplog: pytest.LogCaptureFixture, took: float, records: list[StageRecord]) -> list[logging.LogRecord]:
    runner = Runner(config_from_dict(tiny_config_dict()), Path("unused"), STAGES)
    runner._timings = {"data": took}
    with caplog.at_level(logging.INFO, logger="kiln"):
        runner._say_slow_data(records)
    return [r for r in caplog.records if "data.skip_unchanged" in r.getMessage()]


def test_a_cached_run_mostly_spent_calling_the_data_function_says_so_by_default(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cached = [StageRecord(s.name, "cached", check_seconds=5.0 if s.name == "train" else 0.1) for s in STAGES]
    said = _said(caplog, 4.8, cached)
    assert [r.levelno for r in said] == [logging.WARNING]
    assert "took 4.8 s of checking which stages are cached" in said[0].getMessage()


def test_no_warning_where_the_data_was_used_or_the_call_quick(caplog: pytest.LogCaptureFixture) -> None:
    ran = [StageRecord("train", "ran", check_seconds=5.0)]
    assert [r.levelno for r in _said(caplog, 4.8, ran)] == [logging.INFO]  # -v only: the stage read the data
    caplog.clear()
    assert _said(caplog, 0.2, [StageRecord("train", "cached", check_seconds=0.3)]) == []
