"""report.md's Result line (and the CLI's result line) says where a pass rests on a reference that answers one
class at every held-out row: accuracy is then the class's share, which an engine answering a constant matches."""

from __future__ import annotations

from pathlib import Path

from kiln.core.records import Baseline, EngineValidation, ValidationResult
from kiln.pipeline.config import config_from_dict
from kiln.pipeline.report import build_report, render_markdown, result_line
from kiln.pipeline.runner import RunResult, StageRecord
from tests.conftest import tiny_config_dict

ONE = "decides negative at all 512 rows of output 'logits'"


def _report(tmp_path: Path, one_class: str | None, metric: str | None = None) -> dict:
    engine = EngineValidation(name="e", backend="b", precision="fp32", device="cpu", status="validated", passed=True)
    base = Baseline(accuracy=0.9512, samples=512, latency_ms={}, logits_output="logits", metric_name=metric)
    v = ValidationResult(passed=True, baseline=base, engines=[engine], failures=[], one_class=one_class)
    cfg = config_from_dict(tiny_config_dict(), source=str(tmp_path / "kiln.yaml"))
    return build_report(RunResult(tmp_path / "wd", [StageRecord("validate", "ran", 0.1, summary=v)]), cfg)


def test_a_pass_on_a_one_class_reference_says_so_in_the_result_line(tmp_path: Path) -> None:
    report = _report(tmp_path, ONE)
    line = next(x for x in render_markdown(report).splitlines() if x.startswith("**Result:"))
    assert line.startswith(f"**Result: PASSED — but the reference {ONE}: its accuracy is that class's share"), line
    assert "ranking metric (validate.metric" in line, line
    assert result_line(report).startswith("PASSED — but the reference decides negative")


def test_a_set_metric_is_named_as_the_gate_that_counts(tmp_path: Path) -> None:
    line = result_line(_report(tmp_path, ONE, metric="ctr:auc"))
    assert "validate.metric (ctr:auc) is the gate that counts" in line, line


def test_a_reference_answering_several_classes_leaves_the_line_alone(tmp_path: Path) -> None:
    assert result_line(_report(tmp_path, None)) == "PASSED"
