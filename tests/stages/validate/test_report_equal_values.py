"""An integer output (an argmax's class ids) is held to the share of its values equal to the reference's: the
"Compared outputs" sentence says so, since the summary table has no column for it (its cosine cell is empty)."""

from __future__ import annotations

import numpy as np

from kiln.core.compare import compare_outputs
from kiln.core.records import Baseline, EngineValidation, Percentiles, ValidationResult
from kiln.stages.validate.report import report_section


def _compared_line(compared: dict[str, np.ndarray], logits: str | None) -> str:
    """The "Compared outputs" sentence of one engine that answers ``compared`` exactly."""
    timed = {"8": Percentiles(p50=0.1, p90=0.1, p99=0.1)}
    e = EngineValidation(name="e", backend="onnxruntime", precision="int8", device="cpu", status="validated")
    e.passed, e.latency_ms = True, timed
    e.outputs = {n: s.as_dict() for n, s in compare_outputs(compared, compared).items()}
    e.gates = {"min_cosine": 0.99, "min_top1_agreement": 0.99}
    b = Baseline(accuracy=None, samples=8, latency_ms=timed, logits_output=logits)
    b.compared = list(compared)
    lines = report_section(ValidationResult(passed=True, baseline=b, engines=[e], failures=[]))
    return next(x for x in lines if x.startswith("Compared outputs"))


def test_an_integer_output_is_said_to_be_held_to_its_share_of_equal_values() -> None:
    pred = np.arange(8, dtype=np.int64) % 3
    line = _compared_line({"pred": pred}, "pred")
    assert "'pred' holds integers (class ids, flags): held to the share of its values equal" in line, line
    assert "`min_top1_agreement`" in line and "no top-1 agreement (it holds integers, no class scores)" in line, line
    assert "one value per row" not in line, line


def test_a_float_output_gets_no_equal_values_note() -> None:
    scores = np.random.default_rng(0).standard_normal((8, 3)).astype(np.float32)
    assert "equal to the reference's" not in _compared_line({"scores": scores}, None)
