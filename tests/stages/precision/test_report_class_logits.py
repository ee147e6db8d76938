"""report.md's precision section says no output is class logits only where the variants' checks say so."""

from __future__ import annotations

from kiln.pipeline.report import render_markdown
from tests.stages.precision.test_report import _report

WHY = "int8 not made: no fallback round passed the gates its engines face (top1_agreement 0.91 < 0.97)"


def test_every_variant_failed_says_nothing_of_class_logits() -> None:
    """Every variant but FP32 failed: none recorded a figure, so none recorded a top-1 agreement either, and the
    model's class logits are not denied."""
    md = render_markdown(_report({"variants": {"fp32": {"kept_fp32": 0}}, "failed": {"int8": WHY}}))
    assert "| int8 | **failed, not built** |" in md, md
    assert "No output is class logits" not in md, md


def test_a_variant_checked_without_a_top1_agreement_has_no_class_logits() -> None:
    fp16 = {"kept_fp32": 0, "top1_agreement": None, "cosine": 0.9999993, "rel_err": 0.0012}
    md = render_markdown(_report({"variants": {"fp32": {"kept_fp32": 0}, "fp16": fp16}, "failed": {"int8": WHY}}))
    assert "No output is class logits" in md, md
