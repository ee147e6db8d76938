"""run_pipeline's arguments (the config as a KilnConfig, a dict or a file; stage names as a set or one string) and
its logging (a stage's repeated warning said once per run), on a stand-in runner that records what it was given."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import yaml

from kiln.core.errors import ConfigError
from kiln.pipeline import api
from kiln.pipeline.config import KilnConfig, config_from_dict
from kiln.pipeline.runner import RunResult
from tests.conftest import tiny_config_dict

WARNING = "the reference puts class 3 on top at all 64 of its rows"


class _Runner:
    """Stands in for the pipeline's runner: keeps its config and ``force``, and logs a stage's warning twice."""

    given: list[tuple[KilnConfig, set[str] | None, list[str]]] = []

    def __init__(self, config: KilnConfig, workdir: Path, stages: list[Any], *args: Any, **kw: Any) -> None:
        self.config, self.workdir, self.stages = config, workdir, stages

    def run(self, force: set[str] | None = None, **kw: Any) -> RunResult:
        _Runner.given.append((self.config, force, [s.name for s in self.stages]))
        for _ in range(2):
            logging.getLogger("kiln.validate").warning(WARNING)
        return RunResult(self.workdir, [])


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> list[tuple[KilnConfig, set[str] | None, list[str]]]:
    _Runner.given = []
    monkeypatch.setattr(api, "Runner", _Runner)
    monkeypatch.setattr(api, "write_report", lambda *a: {})
    return _Runner.given


def test_a_dict_or_a_config_files_path_is_read_as_the_config(tmp_path: Path, stand_in: list) -> None:
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(tiny_config_dict(seed=7)))
    api.run_pipeline(tiny_config_dict(seed=5), tmp_path / "a")
    api.run_pipeline(str(tmp_path / "c.yaml"), tmp_path / "b")
    api.run_pipeline(tmp_path / "c.yaml", tmp_path / "c")
    assert [(type(c), c.seed) for c, _, _ in stand_in] == [(KilnConfig, 5), (KilnConfig, 7), (KilnConfig, 7)]


def test_any_other_config_is_a_config_error_before_anything_is_written(tmp_path: Path, stand_in: list) -> None:
    with pytest.raises(ConfigError) as caught:
        api.run_pipeline(3, tmp_path / "w")  # type: ignore[arg-type]
    assert "run_pipeline takes a KilnConfig, a dict or a config file path, got int" in caught.value.message
    assert caught.value.hint and not (tmp_path / "w").exists() and stand_in == []


def test_a_single_stage_name_is_one_stage_not_its_letters(tmp_path: Path, stand_in: list) -> None:
    config = config_from_dict(tiny_config_dict())
    api.run_pipeline(config, tmp_path / "w", force="validate")
    api.run_pipeline(config, tmp_path / "w", only="validate")
    assert stand_in[0][1] == {"validate"} and stand_in[1][2] == ["validate"]


def test_a_stages_repeated_warning_reaches_a_handler_once_per_run(tmp_path: Path, stand_in: list) -> None:
    """No handler of Kiln's is needed: a notebook's own handler (here one on the logger) hears it once."""
    heard: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: heard.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("kiln.validate")
    logger.addHandler(handler)
    before = list(logger.filters)
    try:
        config = config_from_dict(tiny_config_dict())
        api.run_pipeline(config, tmp_path / "w")
        api.run_pipeline(config, tmp_path / "w")  # a new run says it again
        assert heard == [WARNING, WARNING] and logger.filters == before  # the filter goes with the run
    finally:
        logger.removeHandler(handler)


def test_the_result_names_the_report_the_run_wrote(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``result.report_path`` is where the report is written (the real writer, a stand-in runner)."""
    monkeypatch.setattr(api, "Runner", _Runner)
    result, report = api.run_pipeline(config_from_dict(tiny_config_dict()), tmp_path / "w")
    assert result.report_path.is_file() and yaml.safe_load(result.report_path.read_text())["ok"] == report["ok"]
