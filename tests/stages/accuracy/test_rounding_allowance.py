"""An output that barely varies between samples (a matching head's one logit): its relative error over that small
spread does not fail an FP16 engine whose error over the output's norm is within FP16's own rounding."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.core.records import EngineValidation
from kiln.stages.accuracy.check import accuracy_failures, compare_all, gates_for, summarize
from kiln.stages.accuracy.config import GatesConfig


def failures(norm_error: float, precision: str) -> list[str]:
    """The gates an engine of ``precision`` misses whose ``itm`` [64, 1] (varying by 1 % of its level between
    samples) is off by ``norm_error`` of its norm, beside class logits it gets right."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((64, 5)).astype(np.float32)
    itm = (3.0 + 0.03 * rng.standard_normal((64, 1))).astype(np.float32)
    noise = rng.choice([-1.0, 1.0], size=itm.shape).astype(np.float32)
    ref = {"logits": logits, "itm": itm}
    got = {"logits": logits, "itm": itm * (1 + norm_error * noise)}
    stats = compare_all(ref, got, "logits")
    entry = EngineValidation(name="e", backend="onnxruntime", precision=precision, device="cpu", status="validated")
    summarize(entry, stats, "logits")
    return accuracy_failures(entry, gates_for(GatesConfig(), precision), None)


def test_fp16_rounding_over_a_small_spread_passes() -> None:
    assert failures(0.003, "fp16") == []


@pytest.mark.parametrize(("norm_error", "precision"), [(0.003, "fp32"), (0.003, "int8"), (0.02, "fp16")])
def test_fp32_int8_or_an_error_beyond_the_rounding_still_fails(norm_error: float, precision: str) -> None:
    fails = failures(norm_error, precision)
    assert len(fails) == 1 and fails[0].startswith("output 'itm' relative error"), fails
    if precision == "fp16":
        assert "more than FP16's own rounding gives (0.0039)" in fails[0]
