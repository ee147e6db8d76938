"""A cosine of NaN names the side without a number: where one side answers NaN/inf at rows the other is finite, the
failure says which side (the engine or the reference), at how many rows and the first of them."""

from __future__ import annotations

import numpy as np

from kiln.core.records import EngineValidation
from kiln.stages.accuracy.check import Reference, accuracy_failures, compare_on, gates_for, summarize
from kiln.stages.accuracy.config import GatesConfig

RNG = np.random.default_rng(0)
W = RNG.standard_normal((4, 3)).astype(np.float32)
X = np.abs(RNG.standard_normal((64, 4))).astype(np.float32)
X[[16, 40, 50], 0] = -1.0  # rows whose square root is NaN


def _finite(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"y": np.sqrt(np.abs(feed["x"])) @ W}


def _nan(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    with np.errstate(invalid="ignore"):
        return {"y": np.sqrt(feed["x"]) @ W}


def _failures(reference, engine) -> list[str]:
    ref = Reference(reference, [({}, {"x": X})], [None], None, 64)
    entry = EngineValidation(name="e", backend="b", precision="fp32", device="cpu", status="validated")
    entry.gates = gates_for(GatesConfig(), "fp32", True)
    summarize(entry, compare_on(ref, engine, [64]).stats, None)
    return accuracy_failures(entry, entry.gates, None)


def test_the_engine_side_is_named() -> None:
    fails = _failures(_finite, _nan)
    said = "cosine undefined (the engine answers NaN/inf at 3 rows (first: 16) where the reference is finite)"
    assert any(said in f for f in fails), fails


def test_the_reference_side_is_named() -> None:
    fails = _failures(_nan, _finite)
    said = "cosine undefined (the reference answers NaN/inf at 3 rows (first: 16) where the engine is finite)"
    assert any(said in f for f in fails), fails
