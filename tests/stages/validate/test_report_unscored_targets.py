"""Targets per position that fit no validated shape, beside no class-logit output (an image-to-image model's float
targets): the report says the metric was not measured, not a task accuracy that such a model never has."""

from kiln.core.records import Baseline, ValidationResult
from kiln.stages.validate.report import report_section


def _compared(logits_output: str | None) -> str:
    b = Baseline(accuracy=None, samples=8, latency_ms={})
    b.compared, b.logits_output, b.labelled_positions, b.shapes = ["out"], logits_output, 0, [{"h": 48}]
    lines = report_section(ValidationResult(passed=True, baseline=b, engines=[], failures=[]))
    return next(x for x in lines if x.startswith("Compared outputs"))


def test_targets_without_class_logits_say_the_metric_not_measured() -> None:
    line = _compared(None)
    assert "the task metric not measured" in line and "task accuracy" not in line, line


def test_labels_beside_class_logits_still_say_task_accuracy() -> None:
    assert "task accuracy not measured" in _compared("out")
