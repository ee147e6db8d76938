"""report.md's precision section names a multi-label head's agreement as validation's section does: decision
agreement, not top-1."""

from __future__ import annotations

from types import SimpleNamespace

from kiln.stages.precision.report import report_section

VARIANT = {
    "kept_fp32": 0,
    "top1_agreement": 0.97,
    "agreement": "decision",
    "ort_cpu_scheme": "dynamic",
    "ort_cpu_top1_agreement": 0.96,
    "ort_cpu_agreement": "decision",
}


def _section(variant: dict) -> str:
    summary = SimpleNamespace(variants={"int8": variant}, failed={}, node_error_plot=None)
    return "\n".join(report_section(summary))


def test_decision_agreement_is_named_in_the_table_and_the_ort_cpu_line() -> None:
    text = _section(VARIANT)
    assert "decision agreement vs FP32 graph" in text
    assert "checked on its own: decision agreement 0.96" in text
    assert "top-1" not in text


def test_top1_agreement_keeps_its_name() -> None:
    text = _section({k: v for k, v in VARIANT.items() if not k.endswith("agreement") or "top1" in k})
    assert "top-1 agreement vs FP32 graph" in text and "checked on its own: top-1 agreement 0.96" in text
