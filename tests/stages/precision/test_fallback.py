"""The INT8 fallback spends its rounds on nodes whose keeping in float changes the quantized graph: a Relu between two
Convs computes nothing in INT8 (the Q/DQ pairs around it are its neighbours' quantization), so its error is blamed
on the Conv that computes its input; and picks that leave the graph as it was are no round, passed over for the next
nodes without counting toward the stall check."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.calibration.config import CalibrationConfig
from kiln.calibration.quantize import quantize_int8
from kiln.stages.precision import fallback
from kiln.stages.precision.config import FallbackConfig
from kiln.stages.precision.gate import GateCheck, Verdict
from kiln.stages.precision.variants import Source


def conv_relu_conv() -> onnx.ModelProto:
    """Conv (biased low: its ReLU zeroes most values) -> Relu -> Conv -> GlobalAveragePool -> Flatten (logits). The
    relative error rises across the sparse ReLU output, so blame by jump alone would pick the Relu."""
    rng = np.random.default_rng(0)
    inits = {
        "w1": (rng.standard_normal((8, 3, 3, 3)) * 0.4).astype(np.float32),
        "b1": np.full(8, -2.0, np.float32),
        "w2": (rng.standard_normal((10, 8, 3, 3)) * 0.4).astype(np.float32),
    }
    nodes = [
        helper.make_node("Conv", ["input", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("GlobalAveragePool", ["c2"], ["p"], name="pool"),
        helper.make_node("Flatten", ["p"], ["logits"], name="flat"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, 8, 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_the_error_a_relu_carries_is_blamed_on_the_conv_before_it(tmp_path: Path) -> None:
    """The symmetric Q/DQ graph quantizes the Conv's output for the Relu; the rounding shows at the Relu's output,
    and keeping the Relu alone in float leaves it there: round 1 keeps the Conv, whose reason names the Relu."""
    rng = np.random.default_rng(1)
    cal = [rng.standard_normal((16, 3, 8, 8)).astype(np.float32) for _ in range(2)]
    src = Source.prepare(conv_relu_conv(), tmp_path / "fp32" / "model.onnx", cal, None)
    ccfg = CalibrationConfig(cache=False)
    ranges = src.ranges(ccfg.method, ccfg)
    out = tmp_path / "int8" / "model.onnx"
    qdq: list[int] = []

    def build(extra: set[str]) -> Path:
        qdq.append(quantize_int8(src.path, out, ranges, ccfg, extra)["qdq_nodes"]["QuantizeLinear"])
        return out

    check = GateCheck.on_samples(src.model, rng.standard_normal((32, 3, 8, 8)).astype(np.float32))
    cfg = FallbackConfig(nodes_per_round=1, max_rounds=1, min_cosine=0.9999999)  # a gate no INT8 graph meets
    result = fallback.run_fallback(build, check, "int8", cfg, {"conv1", "relu1", "conv2"}, "int8")
    assert result.tried == ["conv1"], result.tried
    assert qdq[1] < qdq[0]  # round 1's graph quantizes less: the Conv's input and output are float


def test_an_op_that_carries_a_graph_input_is_not_blamed(tmp_path: Path) -> None:
    """A Relu straight on the graph's input carries the input's quantization, which no node computes: not picked."""
    rng = np.random.default_rng(2)
    model = conv_relu_conv()
    model.graph.node[0].input[0] = "x_relu"
    model.graph.node.insert(0, helper.make_node("Relu", ["input"], ["x_relu"], name="relu0"))
    src = Source.prepare(
        model, tmp_path / "fp32" / "model.onnx", [rng.standard_normal((16, 3, 8, 8)).astype(np.float32)], None
    )
    ccfg = CalibrationConfig(cache=False)
    out = tmp_path / "model.int8.onnx"
    quantize_int8(src.path, out, src.ranges(ccfg.method, ccfg), ccfg)
    x = rng.standard_normal((16, 3, 8, 8)).astype(np.float32)
    picks = fallback.blame(src.model, out, x, {n.name for n in model.graph.node}, set(), 4, True)
    assert picks and not {"relu0", "relu1"} & set(picks), picks
    assert "at relu1's output (a Relu" in picks["conv1"], picks


class ScriptedCheck:
    """Passes once node ``c`` is kept in float; before, misses top-1 agreement by the same amount every round."""

    fp32, samples = None, np.zeros((4, 2))

    def __init__(self, built: list[set[str]]) -> None:
        self.built = built

    def __call__(self, path: Path, precision: str, cfg: FallbackConfig) -> Verdict:
        ok = "c" in self.built[-1]
        metrics = {"top1_agreement": 1.0 if ok else 0.9, "cosine": 0.9999 if ok else 0.99}
        return Verdict(metrics, [] if ok else ["top1_agreement 0.9000 < 0.97"], np.zeros((4, 2)), np.zeros((4, 2)))


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_picks_that_leave_the_graph_as_it_was_are_no_round(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, precision: str
) -> None:
    """Blame ranks r1, r2, then c; keeping r1 or r2 in float builds the same graph. Judged as rounds, the two would
    gain nothing and stop the search (PATIENCE) before c; passed over, round 1 keeps c and passes. The nodes passed
    over are neither kept nor tried, and the round they were picked after lists them."""
    ranked = ["r1", "r2", "c", "d"]

    def blame(fp32: object, path: Path, x: object, candidates: set[str], kept: set[str], count: int, *_: object):
        left = [n for n in ranked if n in candidates and n not in kept]
        return {n: f"ranked {ranked.index(n)}" for n in left[:count]}

    monkeypatch.setattr(fallback, "blame", blame)
    built: list[set[str]] = []

    def build(extra: set[str]) -> Path:  # r1 and r2 change nothing in the graph written
        built.append(set(extra))
        (tmp_path / "variant.onnx").write_text(",".join(sorted(extra - {"r1", "r2"})))
        return tmp_path / "variant.onnx"

    cfg = FallbackConfig(nodes_per_round=1, max_rounds=4)
    with caplog.at_level(logging.INFO, logger="kiln.precision"):
        result = fallback.run_fallback(build, ScriptedCheck(built), precision, cfg, set(ranked), precision)
    assert result.passed and result.tried == ["c"] and set(result.kept) == {"c"}, result.rounds
    assert len(result.rounds) == 2 and result.rounds[0]["inert"] == ["r1", "r2"]
    assert not any("stopped" in r for r in result.rounds)
    said = [r.getMessage() for r in caplog.records]
    assert any("keeping r1 in float leaves the graph as it was" in m for m in said), said


def test_no_pick_left_that_changes_the_graph_ends_the_search(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every pick leaves the graph as it was: no round after round 0, and the search says no node is left."""
    monkeypatch.setattr(
        fallback,
        "blame",
        lambda fp32, path, x, candidates, kept, count, *_: dict.fromkeys(sorted(candidates - kept)[:count], "why"),
    )
    built: list[set[str]] = []

    def build(extra: set[str]) -> Path:
        built.append(set(extra))
        (tmp_path / "variant.onnx").write_text("the same graph")
        return tmp_path / "variant.onnx"

    result = fallback.run_fallback(build, ScriptedCheck(built), "int8", FallbackConfig(), {"a", "b", "r"}, "int8")
    assert not result.passed and len(result.rounds) == 1 and result.tried == [] and result.kept == {}
    assert result.rounds[0]["inert"] == ["a", "b", "r"]


def test_each_rounds_blame_is_logged_with_its_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The blame after a round's line (per-node errors over every activation: seconds at a 3-D model's sizes) says
    how many nodes it picked, in how long, and the round's seconds in all."""
    monkeypatch.setattr(fallback, "blame", lambda fp32, path, x, candidates, kept, count, *_: {"c": "why"})
    built: list[set[str]] = []

    def build(extra: set[str]) -> Path:
        built.append(set(extra))
        (tmp_path / "variant.onnx").write_text(",".join(sorted(extra)))
        return tmp_path / "variant.onnx"

    with caplog.at_level(logging.INFO, logger="kiln.precision"):
        result = fallback.run_fallback(build, ScriptedCheck(built), "int8", FallbackConfig(), {"c"}, "int8")
    said = [r.getMessage() for r in caplog.records]
    assert result.passed and result.tried == ["c"], result.rounds
    blamed = [m for m in said if m.startswith("int8 round 0: blamed 1 node in ")]
    assert len(blamed) == 1 and blamed[0].endswith(" s in all)"), said
    assert said.index(blamed[0]) > next(i for i, m in enumerate(said) if m.startswith("int8 round 0 of at most"))
