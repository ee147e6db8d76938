"""The per-node error compares a tensor only where both graphs compute it with the same op: ONNX Runtime's
quantizer fuses a Relu into the Conv before it and gives the Conv's (pre-ReLU) output the Relu's name."""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kiln.core.onnx_io import infer_shapes
from kiln.stages.precision.node_errors import first_divergence, graph_order, node_error_curves, producers

RNG = np.random.default_rng(0)
W1, W2 = RNG.standard_normal((4, 2, 3, 3)).astype(np.float32), RNG.standard_normal((3, 4, 1, 1)).astype(np.float32)


def _graph(nodes: list, inits: dict[str, np.ndarray]) -> onnx.ModelProto:
    g = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    return infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))


def test_a_fused_relu_is_not_compared_by_name_and_the_real_divergence_is_found() -> None:
    fp32 = _graph(
        [
            helper.make_node("Conv", ["x", "w1"], ["c"], name="conv1", pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["c"], ["r"], name="relu"),
            helper.make_node("Conv", ["r", "w2"], ["y"], name="conv2"),
        ],
        {"w1": W1, "w2": W2},
    )
    # the quantizer's graph: the Conv writes "r" through a uint8 Q/DQ pair (which clips at 0: the ReLU), coarsely
    fused = _graph(
        [
            helper.make_node("Conv", ["x", "w1"], ["c_pre"], name="conv1", pads=[1, 1, 1, 1]),
            helper.make_node("QuantizeLinear", ["c_pre", "s", "z"], ["c_q"], name="q"),
            helper.make_node("DequantizeLinear", ["c_q", "s", "z"], ["r"], name="dq"),
            helper.make_node("Conv", ["r", "w2"], ["y"], name="conv2"),
        ],
        {"w1": W1, "w2": W2, "s": np.array(0.5, np.float32), "z": np.array(0, np.uint8)},
    )
    assert producers(fused)["r"] == "Conv" and producers(fp32)["r"] == "Relu"
    x = {"x": RNG.standard_normal((4, 2, 6, 6)).astype(np.float32)}
    order = graph_order(fp32)
    curve = node_error_curves(fp32, {"int8": fused}, x)["int8"]
    errors = dict(zip((n for n, _ in order), curve))
    assert math.isnan(errors["relu"]) and math.isnan(errors["conv1"])  # another op's value, and no such tensor
    hit = first_divergence(order, curve)
    assert hit is not None and hit["node"] == "conv2", hit  # the quantization error, where it is real
