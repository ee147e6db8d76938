"""report.json and report.md keep validation's batch-coupled outputs: report.md says they are served unbatched."""

from __future__ import annotations

from pathlib import Path

from kiln.core.records import Baseline, ValidationResult
from kiln.pipeline.config import config_from_dict
from kiln.pipeline.report import build_report, render_markdown, validation_of
from kiln.pipeline.runner import RunResult, StageRecord
from tests.conftest import tiny_config_dict


def test_an_output_that_depends_on_the_whole_batch_is_said_in_report_md(tmp_path: Path) -> None:
    """validation.json named the output and report.md did not: build_report left the key out."""
    baseline = Baseline(accuracy=None, samples=32, latency_ms={}, compared=["logits"])
    validation = ValidationResult(passed=True, baseline=baseline, engines=[], failures=[], batch_coupled=["logits"])
    cfg = config_from_dict(tiny_config_dict(), source=str(tmp_path / "kiln.yaml"))
    result = RunResult(tmp_path / "wd", [StageRecord("validate", "ran", 0.1, summary=validation)])
    report = build_report(result, cfg)
    assert report["validation"]["batch_coupled"] == ["logits"]
    assert validation_of(report).batch_coupled == ["logits"]
    markdown = render_markdown(report)
    assert "'logits' depends on the whole batch" in markdown and "served unbatched" in markdown, markdown
