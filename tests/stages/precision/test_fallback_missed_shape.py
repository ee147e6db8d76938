"""The fallback blames nodes at the shapes a variant missed its gates at: a graph that goes wrong only at a validated
length other than the data's own is mended by keeping the node that goes wrong there in float."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kiln.stages.accuracy.check import Reference
from kiln.stages.accuracy.config import GatesConfig
from kiln.stages.precision.config import FallbackConfig
from kiln.stages.precision.fallback import run_fallback
from kiln.stages.precision.gate import GateCheck, session_runner

AXES = {"x": {0: "batch", 1: "seq"}}


def shifted_mean(off_at: int | None = None) -> onnx.ModelProto:
    """x [batch, seq, 4] -> Add "shift" (of 0) -> Relu -> mean over seq; ``off_at``: "shift" adds 3 where seq is that
    size instead (a variant whose one node goes wrong at one validated length only)."""
    inits = [numpy_helper.from_array(np.zeros(1, np.float32), "zero")]
    shift = ["zero"]
    nodes = []
    if off_at is not None:
        inits += [
            numpy_helper.from_array(np.array([1], np.int64), "one"),
            numpy_helper.from_array(np.array([off_at], np.int64), "size"),
            numpy_helper.from_array(np.array([3.0], np.float32), "three"),
        ]
        nodes += [
            helper.make_node("Shape", ["x"], ["shape"], name="shape"),
            helper.make_node("Gather", ["shape", "one"], ["seq"], name="seq_size"),
            helper.make_node("Equal", ["seq", "size"], ["there"], name="is_there"),
            helper.make_node("Cast", ["there"], ["flag"], name="flag", to=TensorProto.FLOAT),
            helper.make_node("Mul", ["flag", "three"], ["off"], name="off"),
        ]
        shift = ["off"]
    nodes += [
        helper.make_node("Add", ["x", *shift], ["t"], name="shift"),
        helper.make_node("Relu", ["t"], ["r"], name="act"),
        helper.make_node("ReduceMean", ["r"], ["y"], name="mean", axes=[1], keepdims=0),
    ]
    g = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        inits,
    )
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    return onnx.shape_inference.infer_shapes(model)


def test_nodes_are_blamed_at_the_shape_the_gates_were_missed_at(tmp_path: Path) -> None:
    x = np.random.default_rng(0).standard_normal((16, 16, 4)).astype(np.float32)
    fp32 = shifted_mean()
    feeds = [({"seq": 8}, {"x": x[:, :8]}), ({"seq": 16}, {"x": x})]  # the data's own shape (seq=16) last
    check = GateCheck(
        fp32, Reference(session_runner(fp32), feeds, [None, None], None, 4, axes=AXES), GatesConfig(), [4]
    )
    onnx.save(fp32, tmp_path / "fp32.onnx")
    onnx.save(shifted_mean(off_at=8), tmp_path / "variant.onnx")

    def build(kept: set[str]) -> Path:  # keeping "shift" in float gives back the FP32 graph
        return tmp_path / ("fp32.onnx" if "shift" in kept else "variant.onnx")

    cfg = FallbackConfig(max_rounds=2, nodes_per_round=1)
    result = run_fallback(build, check, "int8", cfg, {"shift", "act", "mean"}, "int8")
    assert result.rounds[0]["failures"] and all("at seq=8" in f for f in result.rounds[0]["failures"])
    assert result.passed and list(result.kept) == ["shift"]
