"""The fallback's rounds, while the task metric misses its gate, are judged by that metric: rounds that keep more
nodes in float and lift only the cosine (a gate already met) stop the search, said in the result and the log, unless
the metric moves in steps (class decisions), where closing the cosine's way to 1 is progress toward the next step."""

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
    why = str(not_made("int8", {"fallback": record}))
    assert "keeping more nodes in float is not helping" in why
    assert result.rounds[0]["metric_gap"]["name"] == "rel_l2"  # the round keeps the gap it measured...
    assert "rel_l2's relative rise with every node in int8" in why and "int8.max_metric_drop: " in why  # ...read back


def test_a_round_that_closes_the_metric_gap_improves() -> None:
    """While the metric misses its gate, a round improves by closing a tenth of its way to it, whatever the cosine."""
    same = {"top1_agreement": None, "cosine": 0.9999}
    before = MetricGap("rel_l2", 0.5, 0.01, "relative rise")
    assert improves(same, same, before._replace(drop=0.4), before)
    assert not improves({**same, "cosine": 0.99999}, same, before._replace(drop=0.49), before)
    met = before._replace(drop=0.005)  # the metric meets its gate: the cosine decides
    assert improves({**same, "cosine": 0.99999}, same, met, met)


def test_a_metric_that_steps_keeps_the_search_going_while_the_cosine_closes_in(tmp_path: Path) -> None:
    """Accuracy stays put while the flipped 5 % of rows (a small margin) still carry more offset than their margin,
    then passes at once: rounds that close much of the cosine's way to 1 are progress, and round 3 passes."""
    rows, step = 200, 0.001
    w = np.zeros((16, 10), np.float32)
    w[:10, :10] = np.eye(10)
    x = np.zeros((rows, 16), np.float32)
    x[:, 0] = 1.0
    x[:10, 1] = 1.0 - ADDS * step  # class 1 only ADDS steps below class 0 on these rows
    x += np.random.default_rng(0).uniform(0, 1e-4, x.shape).astype(np.float32)
    fp32 = _graph(w, [np.zeros(10, np.float32)] * ADDS)
    offset = np.zeros(10, np.float32)
    offset[:2] = -step, step  # each Add moves class 1 one step toward class 0

    def build(extra: set[str]) -> Path:
        biases = [np.zeros(10, np.float32) if f"add{i}" in extra else offset for i in range(ADDS)]
        path = tmp_path / "variant.onnx"
        onnx.save(_graph(w, biases), str(path))
        return path

    result = run_fallback(build, _accuracy_check(fp32, x), "int8", FallbackConfig(max_rounds=4), _adds(), "int8")
    assert [r["metric"] for r in result.rounds[:3]] == [0.95] * 3  # flat for two rounds...
    assert result.passed and len(result.rounds) == 4  # ...then the third passes
    assert not any("stopped" in r for r in result.rounds)


def _adds() -> set[str]:
    return {f"add{i}" for i in range(ADDS)}


def _accuracy_check(fp32: onnx.ModelProto, x: np.ndarray) -> GateCheck:
    """Validation's check of class logits, gated by accuracy against the FP32 graph's own classes."""
    run = session_runner(fp32)
    labels = run({"input": x})["logits"].argmax(-1)
    accuracy = Metric("acc", lambda o, y: float((o["logits"].argmax(-1) == y).mean()), relative=False)
    ref = Reference(run, [({}, {"input": x})], [None], "logits", 64, targets=labels, metric=accuracy)
    return GateCheck(fp32, ref, GatesConfig(), [64])


def test_class_decisions_count_the_cosine_s_way_to_1_a_smooth_metric_does_not() -> None:
    """With the metric in place, a round closing over a tenth of the cosine's way to 1 improves where the output is
    class logits or where the metric did not move at all, not where a smooth metric moved by less than a tenth of its
    gap; too small a share never does."""
    before = {"top1_agreement": 0.95, "cosine": 0.99994}
    after = {"top1_agreement": 0.95, "cosine": 0.99996}  # a third of its way to 1
    acc = MetricGap("acc", 0.05, 0.01, "drop")
    assert improves(after, before, acc, acc)
    assert not improves({**after, "cosine": 0.999941}, before, acc, acc)
    smooth = MetricGap("rel_l2", 0.546, 0.01, "relative rise")
    real = {"top1_agreement": None, "cosine": 0.99994}
    assert not improves({**real, "cosine": 0.99996}, real, smooth._replace(drop=0.536), smooth)
    assert improves({**real, "cosine": 0.99996}, real, smooth, smooth)  # not moved at all: a count no row changed


def test_a_metric_at_its_gate_does_not_miss_it() -> None:
    """150/200 against 148/200 is a drop of exactly max_metric_drop to the gate (0.010000000000000009 in floats):
    met, so a round's top-1 gain counts as one."""
    at_gate = MetricGap("acc", 150 / 200 - 148 / 200, 0.01, "drop")
    assert not at_gate.missed
    assert improves(
        {"top1_agreement": 0.965, "cosine": 0.999}, {"top1_agreement": 0.90, "cosine": 0.999}, at_gate, at_gate
    )
    assert MetricGap("acc", 0.0101, 0.01, "drop").missed
