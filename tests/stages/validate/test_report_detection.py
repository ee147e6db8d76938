"""The report's reason for no default class-logit output names the rule that takes a detector's class scores."""

from __future__ import annotations

from kiln.core.records import Baseline, ValidationResult
from kiln.stages.validate.report import report_section


def test_the_default_class_logit_rule_names_detection_labels_not_an_unreachable_no_object_clause() -> None:
    b = Baseline(accuracy=None, accuracy_note="the labels are no classes", samples=8, latency_ms={})
    b.logits_output, b.compared, b.metric_name = None, ["logits", "pred_boxes"], "detection_recall"
    lines = report_section(ValidationResult(passed=True, baseline=b, engines=[], failures=[]))
    line = next(x for x in lines if x.startswith("Compared outputs"))
    assert "beside detection labels (float [N, M, 5]) where the outputs' names alone tell the class scores" in line
    assert "one wider" not in line, line
