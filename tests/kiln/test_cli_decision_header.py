"""The console's accuracy table heads a multi-label head's agreement as report.md does: decision, not top-1."""

from __future__ import annotations

import io

from rich.console import Console

from kiln.cli import _accuracy_table
from kiln.core.records import Baseline, EngineValidation, ValidationResult
from kiln.pipeline.report import fmt


def _table(agreement: str) -> str:
    baseline = Baseline(accuracy=None, samples=64, latency_ms={})
    engine = EngineValidation(
        name="onnxruntime-cpu-fp32",
        backend="onnxruntime",
        precision="fp32",
        device="cpu",
        status="validated",
        passed=True,
        cosine=1.0,
        top1_agreement=1.0,
        agreement=agreement,  # type: ignore[arg-type]
    )
    out = io.StringIO()
    validation = ValidationResult(passed=True, baseline=baseline, engines=[engine], failures=[])
    Console(file=out, width=80).print(_accuracy_table(validation, fmt))
    return out.getvalue()


def test_decision_agreement_is_headed_decision() -> None:
    assert "decision" in _table("decision") and "top-1" not in _table("decision")
    assert "top-1" in _table("top1")
