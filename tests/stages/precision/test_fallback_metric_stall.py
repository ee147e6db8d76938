"""The fallback's rounds, while the task metric misses its gate, are judged by that metric: rounds that keep more
nodes in float and lift only the cosine (a gate already met) stop the search, said in the result and the log."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from kiln.stages.accuracy.check import Reference
from kiln.stages.accuracy.config import GatesConfig
from kiln.stages.accuracy.metrics import Metric
from kiln.stages.precision.config import FallbackConfig
from kiln.stages.precision.fallback import PATIENCE, MetricGap, improves, run_fallback
from kiln.stages.precision.gate import GateCheck, session_runner
from kiln.stages.precision.stage import not_made
from tests.stages.precision.precision_graphs import inputs, make_model, rng_weights

ADDS = 10


def _graph(w: np.ndarray, biases: list[np.ndarray]) -> onnx.ModelProto:
    """MatMul, then a chain of bias Adds (``add0`` ...) to the output."""
    nodes = [helper.make_node("MatMul", ["input", "w"], ["h0"], name="mm")]
    inits = {"w": w}
    for i, b in enumerate(biases):
        out = "logits" if i == len(biases) - 1 else f"h{i + 1}"
        nodes.append(helper.make_node("Add", [f"h{i}", f"b{i}"], [out], name=f"add{i}"))
        inits[f"b{i}"] = b
    return make_model(nodes, inits)


def _rel_l2(outputs: dict[str, np.ndarray], labels: np.ndarray) -> float:
    return float(np.linalg.norm(outputs["logits"] - labels) / np.linalg.norm(labels))


def _check(fp32: onnx.ModelProto) -> GateCheck:
    """Validation's check with a relative error metric against float targets near the FP32 graph's outputs."""
    feed = {"input": inputs(256)}
    run = session_runner(fp32)
    targets = run(feed)["logits"] + rng_weights(256, 10, seed=5, scale=0.05)
    metric = Metric("rel_l2", _rel_l2, higher_is_better=False, relative=True)
    ref = Reference(run, [({}, feed)], [None], None, 64, targets=targets, metric=metric)
    return GateCheck(fp32, ref, GatesConfig(), [64])


def test_rounds_that_leave_the_metric_in_place_stop_the_search(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The variant's MatMul is 5 % off whatever is kept (its rel_l2 rises ~50 %, the gate allows 1 %); each kept Add
    removes a small offset, so the cosine rises round after round while the metric barely moves: the search stops
    after PATIENCE rounds, not at max_rounds, and says why."""
    w = rng_weights(16, 10)
    fp32 = _graph(w, [np.zeros(10, np.float32)] * ADDS)
    direction = rng_weights(10, seed=3)
    offsets = [direction * 0.0005 * (ADDS - i) for i in range(ADDS)]

    def build(extra: set[str]) -> Path:
        biases = [np.zeros(10, np.float32) if f"add{i}" in extra else b for i, b in enumerate(offsets)]
        path = tmp_path / "variant.onnx"
        onnx.save(_graph(w * 1.05, biases), str(path))
        return path

    cfg = FallbackConfig(max_rounds=4)
    with caplog.at_level(logging.INFO, logger="kiln.precision"):
        result = run_fallback(build, _check(fp32), "int8", cfg, {f"add{i}" for i in range(ADDS)}, "int8")
    cosines = [r["cosine"] for r in result.rounds]
    assert cosines[1] > cosines[0] and cosines[2] > cosines[1]  # more in float did lift the cosine...
    assert not result.passed and any("rel_l2" in f for f in result.failures)  # ...not the metric
    assert len(result.rounds) == PATIENCE + 1 < cfg.max_rounds + 1
    stopped = result.rounds[-1]["stopped"]
    assert "rel_l2's relative rise" in stopped and "not helping" in stopped
    said = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("int8 round 1 of at most 4: ") and "rel_l2" in m for m in said)
    record = {"passed": False, "failures": result.failures, "tried": result.tried, "rounds": result.rounds}
    assert "keeping more nodes in float is not helping" in str(not_made("int8", {"fallback": record}))


def test_a_round_that_closes_the_metric_gap_improves() -> None:
    """While the metric misses its gate, a round improves by closing a tenth of its way to it, whatever the cosine."""
    same = {"top1_agreement": None, "cosine": 0.9999}
    before = MetricGap("rel_l2", 0.5, 0.01, "relative rise")
    assert improves(same, same, before._replace(drop=0.4), before)
    assert not improves({**same, "cosine": 0.99999}, same, before._replace(drop=0.49), before)
    met = before._replace(drop=0.005)  # the metric meets its gate: the cosine decides
    assert improves({**same, "cosine": 0.99999}, same, met, met)
