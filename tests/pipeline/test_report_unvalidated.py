"""The result line of a run that ended without a validation of this configuration: what it did, not PASSED."""

from __future__ import annotations

from pathlib import Path

from kiln.pipeline.config import config_from_dict
from kiln.pipeline.report import build_report, render_markdown, result_line
from kiln.pipeline.runner import RunResult, StageRecord
from tests.conftest import tiny_config_dict


def test_a_stage_command_after_a_change_says_validation_is_out_of_date() -> None:
    """`kiln export` after a config change printed "result: PASSED" while validation was stale (its verdict left
    out of the report as another configuration's)."""
    statuses = {"train": "kept", "export": "ran"}
    statuses.update(dict.fromkeys(("optimize", "precision", "build", "validate", "package"), "stale"))
    stages = {n: {"status": s, "seconds": 0.0} for n, s in statuses.items()}
    report = {"name": "x", "ok": True, "stages": stages, "environment": {"versions": {}, "python": "3"}}
    line = result_line(report)
    assert line.startswith("export done; validation out of date") and "kiln run" in line, line
    assert "PASSED" not in render_markdown(report)


def test_a_run_that_stopped_before_validation_says_nothing_validated_it(tmp_path: Path) -> None:
    cfg = config_from_dict(tiny_config_dict(), source=str(tmp_path / "kiln.yaml"))
    result = RunResult(tmp_path / "wd", [StageRecord("train", "ran", 0.1), StageRecord("export", "cached", 0.1)])
    line = result_line(build_report(result, cfg))
    assert line.startswith("train, export done; not validated yet") and "PASSED" not in line, line
