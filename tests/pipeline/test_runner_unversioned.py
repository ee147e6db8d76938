"""User code in a ``__main__`` with no file (a notebook, ``python -c``): no version to key, so never cached."""

from __future__ import annotations

import logging
import sys
import types
from pathlib import Path

import pytest

from kiln.core.stage import Stage
from kiln.pipeline.config import config_from_dict
from kiln.pipeline.runner import Runner
from tests.conftest import tiny_config_dict
from tests.pipeline.fake_stages import RAN, ModelSettings, ValueSummary


def test_model_code_in_a_fileless_main_reruns_its_stages_and_warns_once_a_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A notebook's edited class was once reported cached, with the old engine: its code had no key."""
    main = types.ModuleType("__main__")  # no __file__
    main.build = lambda: None
    monkeypatch.setitem(sys.modules, "__main__", main)
    stages = [
        Stage("model", "tests.pipeline.fake_stages:modelled", (), ModelSettings, ValueSummary, (), lambda s: {}),
        Stage(
            "again", "tests.pipeline.fake_stages:modelled", ("model",), ModelSettings, ValueSummary, (), lambda s: {}
        ),
    ]
    cfg = config_from_dict(tiny_config_dict(**{"model.name": "__main__:build", "model.params": {}}))
    for _ in range(2):
        RAN.clear()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kiln"):
            result = Runner(cfg, tmp_path / "wd", stages).run()
        assert result.ok and dict(RAN) == {"model": 1, "again": 1}, (result.error, RAN)
        said = [r.getMessage() for r in caplog.records if "has no file to version" in r.getMessage()]
        assert len(said) == 1 and "model.name '__main__:build'" in said[0], said
