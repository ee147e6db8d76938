"""report.md writes a metric's values and drops with a decimal point (``1.0``, not ``1``), so that a float is not
read as a whole number or as rounded to one."""

from __future__ import annotations

from kiln.core.records import Baseline, EngineValidation, ValidationResult
from kiln.stages.validate.report import metric_text, report_section


def test_a_metric_of_one_keeps_its_digits() -> None:
    engine = EngineValidation(
        name="e-int8", backend="b", precision="int8", device="cpu", status="validated", passed=True, metric=1.0
    )
    engine.gates = {"max_metric_drop": 0.01}
    base = Baseline(accuracy=None, samples=8, latency_ms={}, metric=1.0, metric_name="macro_f1")
    lines = report_section(ValidationResult(passed=True, baseline=base, engines=[engine], failures=[]))
    metric = next(line for line in lines if line.startswith("Metric `macro_f1`"))
    assert "reference 1.0; e-int8 1.0 (" in metric and "(drop 0.0, gate ≤ 0.01)" in metric, metric
    reference = next(line for line in lines if line.startswith("Accuracy reference:"))
    assert "macro_f1 1.0 on 8 held-out samples" in reference, reference


def test_values_keep_their_four_significant_digits() -> None:
    from_report = [metric_text(x) for x in (1.0, 0.0, 24.9, 1.1e6, -0.0006, float("nan"), None)]
    assert from_report == ["1.0", "0.0", "24.9", "1.1e+06", "-0.0006", "nan", "-"]
