"""The validation section of report.md: every value beside the gate that held it, and no gate where none did."""

from __future__ import annotations

from kiln.core.records import Baseline, EngineValidation, Percentiles, ValidationResult
from kiln.stages.validate.report import report_section


def _table(lines: list[str]) -> list[list[str]]:
    start = next(i for i, line in enumerate(lines) if line.startswith("| engine |"))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def test_a_model_without_class_logits_shows_its_relative_error_gate_and_no_top1_gate() -> None:
    engine = EngineValidation(
        name="e", backend="onnxruntime", precision="int8", device="cpu", status="validated", passed=True
    )
    engine.max_abs_err, engine.rel_err, engine.cosine = 0.0103, 0.01137, 0.999939
    engine.gates = {"min_cosine": 0.99, "max_rel_err": 0.141421, "min_top1_agreement": 0.97}
    timed = {"1": Percentiles(p50=0.1, p90=0.1, p99=0.1), "32": Percentiles(p50=0.2, p90=0.2, p99=0.2)}
    engine.latency_ms = timed
    v = ValidationResult(
        passed=True, baseline=Baseline(accuracy=None, samples=8, latency_ms=timed), engines=[engine], failures=[]
    )
    header, separator, *rows = _table(report_section(v))
    assert len(separator) == len(header) and all(len(r) == len(header) for r in rows)
    row = dict(zip(header, rows[-1]))
    assert row["rel err"] == "0.01137 (≤ 0.141421)" and row["top-1 agree"] == "-", row
