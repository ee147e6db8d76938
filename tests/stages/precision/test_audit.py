"""The precision audit: FLOPs per sample of each compute node, the precision the graph gives it, and labels the
graph contradicts."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.stages.precision.audit import audit_graph, label_problem


def graph(dtype: int = TensorProto.FLOAT, qdq: bool = False) -> onnx.ModelProto:
    """x [batch, seq, 8] -> MatMul 8x16 -> y; a Conv on an image input beside it. ``qdq``: the MatMul's weight
    arrives through a DequantizeLinear (an INT8 Q/DQ graph)."""
    np_dtype = np.float16 if dtype == TensorProto.FLOAT16 else np.float32
    inits = [numpy_helper.from_array(np.ones((4, 3, 3, 3), np_dtype), "cw")]
    nodes = [helper.make_node("Conv", ["img", "cw"], ["c"], name="conv", pads=[1, 1, 1, 1])]
    if qdq:
        inits += [
            numpy_helper.from_array(np.ones((8, 16), np.int8), "wq"),
            numpy_helper.from_array(np.array(0.1, np.float32), "s"),
            numpy_helper.from_array(np.array(0, np.int8), "z"),
        ]
        nodes += [
            helper.make_node("DequantizeLinear", ["wq", "s", "z"], ["w"], name="dq"),
            helper.make_node("MatMul", ["x", "w"], ["y"], name="mm"),
        ]
    else:
        inits.append(numpy_helper.from_array(np.ones((8, 16), np_dtype), "w"))
        nodes.append(helper.make_node("MatMul", ["x", "w"], ["y"], name="mm"))
    x_type = TensorProto.FLOAT if qdq else dtype
    g = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", x_type, ["batch", "seq", 8]),
            helper.make_tensor_value_info("img", dtype, ["batch", 3, 6, 6]),
        ],
        [helper.make_tensor_value_info("y", x_type, None), helper.make_tensor_value_info("c", dtype, None)],
        inits,
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_flops_per_sample_at_the_sizes_given() -> None:
    a = audit_graph(graph(), {"seq": 10})
    matmul = 2 * 10 * 8 * 16  # [1, 10, 8] x [8, 16]
    conv = 2 * (4 * 6 * 6) * (3 * 3 * 3)  # every output value: 3x3x3 multiply-adds
    assert a.total == matmul + conv and a.sizes == {"seq": 10} and a.label() == "fp32"
    assert audit_graph(graph(), {"seq": 20}).total == 2 * matmul + conv  # the sequence doubles the MatMul only


def test_precision_comes_from_the_graph() -> None:
    assert audit_graph(graph(TensorProto.FLOAT16)).share() == {"fp16": 1.0}
    qdq = audit_graph(graph(qdq=True), {"seq": 40})
    assert qdq.share()["int8"] > 0.5 and qdq.label() == "int8"  # the MatMul: 10240 FLOPs, the float Conv 7776
    assert audit_graph(graph(qdq=True), {"seq": 10}).label() == "fp32"  # 2560 against 7776: mostly float


def test_a_label_the_graph_contradicts_is_named() -> None:
    fp32 = {"share": {"fp32": 1.0}, "method": "engine graph"}
    assert "computes 0% in fp16" in label_problem(fp32, "fp16")
    assert "labelled fp32" in label_problem({"share": {"int8": 0.9, "fp32": 0.1}, "method": "x"}, "fp32")
    assert label_problem({"share": {"int8": 0.9, "fp32": 0.1}}, "int8") is None
    assert label_problem(fp32, "fp32") is None


@pytest.mark.parametrize("op, gates, layout", [("GRU", 3, 0), ("LSTM", 4, 1), ("RNN", 1, 0)])
def test_recurrent_layers_count_their_flops(op: str, gates: int, layout: int) -> None:
    """An RNN's FLOPs are its W and R products at every step, in both directions: an engine whose linear layers
    run in INT8 beside an FP32 GRU is mostly FP32, not "int8 100 %". Inputs come batch first; time-major layers
    (layout 0) get them transposed, as torch's exporter writes them."""
    hidden, inputs, dirs = 5, 3, 2
    nodes = [] if layout else [helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0, 2])]
    attrs = {"hidden_size": hidden, "direction": "bidirectional", "layout": layout}
    nodes.append(helper.make_node(op, ["xt" if nodes else "x", "w", "r"], ["", "h"], **attrs))
    g = helper.make_graph(
        nodes,
        "rnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", inputs])],
        [helper.make_tensor_value_info("h", TensorProto.FLOAT, None)],
        [
            numpy_helper.from_array(np.ones((dirs, gates * hidden, inputs), np.float32), "w"),
            numpy_helper.from_array(np.ones((dirs, gates * hidden, hidden), np.float32), "r"),
        ],
    )
    audit = audit_graph(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), {"seq": 7})
    assert audit.flops["fp32"] == 2 * 7 * dirs * gates * hidden * (inputs + hidden) and audit.uncounted == 0
