"""The roofline's precision share where the engine's audit could not count every compute node: its floor, and the
nodes left out, not the share of the counted FLOPs alone."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kiln.core.records import Baseline, EngineValidation, Percentiles, ValidationResult
from kiln.stages.validate import stage
from kiln.stages.validate.report import report_section

# an INT8 engine whose Einsum the audit could not size: 100 % of the counted FLOPs in INT8, at least 50 % in all
EINSUM = {
    "flops_per_sample": 2592,
    "share": {"int8": 1.0},
    "share_floor": {"int8": 0.5029},
    "share_covers_nodes": 0.6667,
    "uncounted_ops": {"Einsum": {"fp32": 1}},
}
COUNTED = {"flops_per_sample": 2592, "share": {"int8": 1.0}, "share_floor": {"int8": 1.0}, "uncounted_ops": {}}


def _roofline_rows(audit: dict, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The roofline table's rows of report.md for an engine with ``audit``, as the stage records them."""
    monkeypatch.setattr(stage, "peak_tflops", lambda device, cache: {"device": "cpu", "measured": {"fp32": 1.0}})
    lat = {"1": Percentiles(p50=0.05, p90=0.05, p99=0.05)}
    entry = EngineValidation(
        name="e-int8", backend="b", precision="int8", device="cpu", status="validated", latency_ms=lat
    )
    peaks = stage.add_roofline([stage.Checked(entry, meta=SimpleNamespace(audit=audit))], None)
    v = ValidationResult(
        passed=True,
        baseline=Baseline(accuracy=None, samples=8, latency_ms={}),
        engines=[entry],
        failures=[],
        peaks=peaks,
    )
    lines = report_section(v)
    return [line for line in lines[lines.index("### Roofline") :] if line.startswith("| e-int8 |")]


def test_a_share_the_audit_could_not_count_whole_is_said_as_its_floor(monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine with an uncounted Einsum read "int8 100%" in the roofline: the audit's share of what it counted."""
    (row,) = _roofline_rows(EINSUM, monkeypatch)
    assert "| int8 ≥ 50% (100% of the counted FLOPs); uncounted: Einsum x1 |" in row, row
    (row,) = _roofline_rows(COUNTED, monkeypatch)
    assert "| int8 100% |" in row, row
