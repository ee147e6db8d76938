"""An output without a batch axis (a 0-D loss beside the logits) has no cosine: the "Compared outputs" sentence says
how it is held, and the per-output table leaves its cosine empty."""

from __future__ import annotations

import numpy as np

from kiln.core.compare import compare_outputs
from kiln.core.records import Baseline, EngineValidation, Percentiles, ValidationResult
from kiln.stages.validate.report import report_section


def test_a_scalar_output_is_said_to_be_held_to_its_error_over_its_norm() -> None:
    logits = np.random.default_rng(0).standard_normal((8, 3)).astype(np.float32)
    ref = {"logits": logits, "aux_loss": np.array(2.0, np.float32)}
    got = {"logits": logits, "aux_loss": np.array(3.0, np.float32)}  # 1.5x off: a cosine of one value reads 1
    timed = {"8": Percentiles(p50=0.1, p90=0.1, p99=0.1)}
    e = EngineValidation(name="e", backend="onnxruntime", precision="int8", device="cpu", status="validated")
    e.passed, e.latency_ms = False, timed
    e.outputs = {n: s.as_dict() for n, s in compare_outputs(ref, got).items()}
    e.gates = {"min_cosine": 0.99, "min_top1_agreement": 0.99}
    b = Baseline(accuracy=None, samples=8, latency_ms=timed, logits_output=None)
    b.compared = list(ref)
    lines = report_section(ValidationResult(passed=False, baseline=b, engines=[e], failures=[]))
    line = next(x for x in lines if x.startswith("Compared outputs"))
    assert "'aux_loss' has no batch axis (one value a call): held to its relative error over its norm" in line, line
    row = next(x for x in lines if x.startswith("| e | aux_loss |"))
    assert row.split("|")[5].strip() == "-", row  # its cosine
