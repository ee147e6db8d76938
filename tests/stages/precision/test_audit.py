"""The precision audit: FLOPs per sample of each compute node, the precision the graph gives it, and labels the
graph contradicts."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.stages.precision import audit as audit_module
from kiln.stages.precision.audit import Audit, audit_graph, label_problem


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
    assert audit.flops["fp32"] == 2 * 7 * dirs * gates * hidden * (inputs + hidden) and not audit.uncounted


def attention(d: int = 8) -> onnx.ModelProto:
    """x [batch, seq, d] -> q, k, v (INT8 Q/DQ MatMuls) -> softmax(q k^T) v: two activation x activation MatMuls in
    FP32. k passes a Slice to the sequence's length, its end taken from x's Shape (as a transformer's position ids
    are): onnx's shape inference leaves k's length unknown even at concrete input sizes, so both attention MatMuls."""
    inits = [
        numpy_helper.from_array(np.array(0.1, np.float32), "s"),
        numpy_helper.from_array(np.array(0, np.int8), "z"),
        numpy_helper.from_array(np.array([0], np.int64), "zero"),
        numpy_helper.from_array(np.array([1], np.int64), "one"),
    ]
    nodes = []
    for w in "qkv":
        inits.append(numpy_helper.from_array(np.ones((d, d), np.int8), f"w{w}"))
        nodes += [
            helper.make_node("DequantizeLinear", [f"w{w}", "s", "z"], [f"w{w}f"]),
            helper.make_node("MatMul", ["x", f"w{w}f"], [w], name=f"mm_{w}"),
        ]
    nodes += [
        helper.make_node("Shape", ["x"], ["seq"], start=1, end=2),
        helper.make_node("Slice", ["k", "zero", "seq", "one"], ["ks"]),
        helper.make_node("Transpose", ["ks"], ["kt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "kt"], ["scores"], name="scores"),
        helper.make_node("Softmax", ["scores"], ["probs"], axis=-1),
        helper.make_node("MatMul", ["probs", "v"], ["y"], name="context"),
    ]
    g = helper.make_graph(
        nodes,
        "attention",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", d])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_attention_matmuls_on_symbolic_sizes_are_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    """An INT8 encoder's FP32 attention MatMuls count at the sizes given: at seq 32 they are most of its FLOPs, so
    it is not "int8 100 %" and an INT8 label is refused."""
    seq, d = 32, 8
    linear, attn = 3 * 2 * seq * d * d, 2 * 2 * seq * seq * d  # q, k, v projections; q k^T and probs v
    a = audit_graph(attention(d), {"seq": seq})
    assert a.flops == {"int8": linear, "fp32": attn} and not a.uncounted and a.covers() == 1.0
    assert a.share() == {"int8": round(linear / (linear + attn), 4), "fp32": round(attn / (linear + attn), 4)}
    assert a.label() == "fp32" and "labelled int8, it computes 27% in int8" in label_problem(a.record(), "int8")

    # without ONNX Runtime's symbolic shape inference (the audit before it), onnx's alone leaves them uncounted
    monkeypatch.setattr(audit_module, "_symbolic_shapes", lambda model: {})
    before = audit_graph(attention(d), {"seq": seq})
    assert before.flops == {"int8": linear} and before.share() == {"int8": 1.0}
    # ... recorded by precision, and the share says what it covers and how low it may be
    record = before.record()
    assert record["uncounted_nodes"] == {"fp32": 2} and record["share_covers_nodes"] == 0.6
    assert record["share_floor"] == {"int8": round(linear / (linear + 2 * linear // 3), 4)}  # each as mm_q


def test_uncounted_nodes_weigh_against_a_low_label() -> None:
    """A compute node whose FLOPs cannot be counted is not dropped from the judgement: each weighs as the largest
    counted node, in the precision it runs in, against the others (the share's floor)."""
    a = Audit(flops=Counter(int8=300), nodes=Counter(int8=3, fp32=4), uncounted=Counter(fp32=4), largest=100)
    assert a.share() == {"int8": 1.0} and a.floor() == {"int8": round(300 / 700, 4)} and a.label() == "fp32"
    assert "as little as 43% with its uncounted compute nodes {'fp32': 4}" in label_problem(a.record(), "int8")
    int8 = Audit(flops=Counter(int8=300), nodes=Counter(int8=4), uncounted=Counter(int8=1), largest=100)
    assert int8.floor() == {"int8": 1.0} and label_problem(int8.record(), "int8") is None
