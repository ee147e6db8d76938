"""max_systematic_err: an engine whose values are off by a scale or an offset on every sample fails, though its
cosine is 1 and its relative error is within the noise max_rel_err allows; an engine of noise alone passes. An
8-bit engine's softmax class logits are spared, as they are max_rel_err's derived limit."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.core.records import EngineValidation
from kiln.stages.accuracy.check import (
    CheckConfig,
    OutputStats,
    accuracy_failures,
    compare_all,
    gates_for,
    merge_worst,
    summarize,
)
from kiln.stages.accuracy.config import GatesConfig

RNG = np.random.default_rng(1)
REF = RNG.standard_normal((128, 16)).astype(np.float32)


def _failures(ref: np.ndarray, got: np.ndarray, precision: str, logits: str | None = None) -> list[str]:
    """The gates an engine of ``precision`` answering ``got`` misses where the reference answers ``ref``."""
    stats = compare_all({"out": ref}, {"out": got}, logits)
    entry = EngineValidation(name="e", backend="onnxruntime", precision=precision, device="cpu", status="validated")
    entry.gates = gates_for(CheckConfig(), precision, logits is None)
    summarize(entry, stats, logits)
    return accuracy_failures(entry, entry.gates, None)


@pytest.mark.parametrize(
    ("precision", "got"),
    [
        ("int8", 1.12 * REF),  # a UNet's noise prediction x1.12: rel_err 0.12 < 0.1414
        ("int8", 1.05 * REF),
        ("int8", REF + 0.1 * REF.std()),  # a shift of a tenth of the spread
        ("fp32", REF + 0.0098 * REF.std()),  # a forecaster's +1.0 on a spread of 100: rel_err 0.0098 < 0.0141
    ],
)
def test_a_scale_or_offset_fails_the_systematic_gate_alone(precision: str, got: np.ndarray) -> None:
    failures = _failures(REF, got.astype(np.float32), precision)
    assert len(failures) == 1 and failures[0].startswith("systematic error "), failures
    assert "the reference's" in failures[0] and "on average" in failures[0]
    assert f"per_precision.{precision}.max_systematic_err" in failures[0]


def test_the_message_says_the_scale_and_the_offset() -> None:
    (failure,) = _failures(REF, (1.12 * REF).astype(np.float32), "int8")
    assert "1.12x the reference's" in failure


def test_quantization_noise_passes() -> None:
    """An INT8 engine's error: 8 % of the spread, random, on no line."""
    assert _failures(REF, REF + 0.08 * RNG.standard_normal(REF.shape).astype(np.float32), "int8") == []


def test_int8_softmax_class_logits_are_spared() -> None:
    """Calibrated ranges may scale an 8-bit engine's class logits as a whole: top-1 agreement guards them."""
    assert _failures(REF, 1.12 * REF, "int8", logits="out") == []
    assert _failures(REF, 1.12 * REF, "fp16", logits="out") != []


def test_defaults_per_precision() -> None:
    gates = GatesConfig()
    values = {p: gates.of_precision(p)["max_systematic_err"] for p in ("fp32", "fp16", "int8", "fp8")}
    assert values["fp32"] < values["fp16"] < values["int8"] == values["fp8"]
    assert GatesConfig(max_systematic_err=None).of_precision("fp32")["max_systematic_err"] is None


def test_merged_stats_keep_the_worse_line_with_its_slope() -> None:
    a = {"out": OutputStats(0.1, 0.1, 1.0, None, systematic_err=0.01, slope=1.01, shift=0.0)}
    b = {"out": OutputStats(0.1, 0.1, 1.0, None, systematic_err=0.12, slope=1.12, shift=0.1)}
    merged = merge_worst(a, b)["out"]
    assert (merged.systematic_err, merged.slope, merged.shift) == (0.12, 1.12, 0.1)
    assert merge_worst(b, a)["out"].slope == 1.12
