"""The precision audit: FLOPs per sample of each compute node, the precision the graph gives it, and labels the
graph contradicts."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

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


def attention(d: int = 8, quantized_x: bool = False) -> onnx.ModelProto:
    """x [batch, seq, d] -> q, k, v (INT8 Q/DQ MatMuls) -> softmax(q k^T) v: two activation x activation MatMuls in
    FP32. k passes a Slice to the sequence's length, its end taken from x's Shape (as a transformer's position ids
    are): onnx's shape inference leaves k's length unknown even at concrete input sizes, so both attention MatMuls.
    ``quantized_x``: x passes a uint8 Q/DQ pair too, so ONNX Runtime's CPU provider fuses the projections into
    integer ops (MatMulIntegerToFloat); without it they are weight-only Q/DQ, which it runs in float."""
    inits = [
        numpy_helper.from_array(np.array(0.1, np.float32), "s"),
        numpy_helper.from_array(np.array(0, np.int8), "z"),
        numpy_helper.from_array(np.array([0], np.int64), "zero"),
        numpy_helper.from_array(np.array([1], np.int64), "one"),
    ]
    nodes = []
    if quantized_x:
        inits += [
            numpy_helper.from_array(np.array(0.05, np.float32), "xs"),
            numpy_helper.from_array(np.array(128, np.uint8), "xz"),
        ]
        nodes += [
            helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
            helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
        ]
    for w in "qkv":
        inits.append(numpy_helper.from_array(np.ones((d, d), np.int8), f"w{w}"))
        nodes += [
            helper.make_node("DequantizeLinear", [f"w{w}", "s", "z"], [f"w{w}f"]),
            helper.make_node("MatMul", ["xd" if quantized_x else "x", f"w{w}f"], [w], name=f"mm_{w}"),
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

    # without ONNX Runtime's symbolic shape inference or a run of the graph, onnx's alone leaves them uncounted
    monkeypatch.setattr(audit_module, "_symbolic_shapes", lambda model: {})
    monkeypatch.setattr(audit_module, "_run_shapes", lambda model, pinned, names: {})
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
    problem = label_problem(a.record(), "int8")
    assert problem.startswith("labelled int8, 3 of its 7 compute nodes run in int8 and 4 in fp32 could not be sized:")
    assert "100% of the FLOPs counted run in int8, as little as 43% with those 4" in problem
    int8 = Audit(flops=Counter(int8=300), nodes=Counter(int8=4), uncounted=Counter(int8=1), largest=100)
    assert int8.floor() == {"int8": 1.0} and label_problem(int8.record(), "int8") is None


def qdq_linear(inits: list[onnx.TensorProto], nodes: list[onnx.NodeProto], x: str, d: int, out: str) -> None:
    """``out = x @ W``, W [d, 16] an INT8 weight through a DequantizeLinear (appended to ``inits`` and ``nodes``)."""
    inits += [
        numpy_helper.from_array(np.ones((d, 16), np.int8), "wq"),
        numpy_helper.from_array(np.array(0.1, np.float32), "s"),
        numpy_helper.from_array(np.array(0, np.int8), "z"),
    ]
    nodes += [
        helper.make_node("DequantizeLinear", ["wq", "s", "z"], ["w"], name="dq"),
        helper.make_node("MatMul", [x, "w"], [out], name="mm"),
    ]


def fourier_mixer(opset: int, d: int = 8) -> onnx.ModelProto:
    """FNet's token mixing beside an INT8 linear layer: x [batch, seq, d] real -> DFT over seq -> DFT over d (a 2-D
    FFT, as torch.fft.fft2 exports), in FP32. Opset 17 gives the DFT's axis as an attribute, opset 20 as an input.
    The signal arrives through a QuantizeLinear/DequantizeLinear pair, as in a Q/DQ graph (no runtime transforms it
    in INT8: the DFT computes in float)."""
    inits = [numpy_helper.from_array(np.array([-1], np.int64), "last")]
    nodes = [
        helper.make_node("Unsqueeze", ["x", "last"], ["xr"]),
        helper.make_node("QuantizeLinear", ["xr", "s", "z"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"]),
    ]
    for i, (src, axis) in enumerate([("xd", 1), ("f1", 2)]):
        if opset >= 20:
            inits.append(numpy_helper.from_array(np.array(axis, np.int64), f"axis{i}"))
            nodes.append(helper.make_node("DFT", [src, "", f"axis{i}"], [f"f{i + 1}"], name=f"dft{i}"))
        else:
            nodes.append(helper.make_node("DFT", [src], [f"f{i + 1}"], name=f"dft{i}", axis=axis))
    qdq_linear(inits, nodes, "x", d, "y")
    g = helper.make_graph(
        nodes,
        "fnet",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", d])],
        [helper.make_tensor_value_info("f2", TensorProto.FLOAT, None), helper.make_tensor_value_info("y", 1, None)],
        inits,
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


@pytest.mark.parametrize("opset", [17, 20])
def test_fourier_transforms_count_their_flops(opset: int) -> None:
    """FNet's FP32 DFTs beside INT8 linear layers: counted as FFTs (5 N log2 N per complex transform of length N,
    half that for a real signal), not left out of an "int8 100 %" that says it covers every node."""
    seq, d = 16, 8
    real = 2.5 * seq * 4 * d  # d real transforms of length seq (log2 16 = 4)
    cplx = 5 * d * 3 * seq  # seq complex transforms of length d (log2 8 = 3)
    linear = 2 * seq * d * 16
    a = audit_graph(fourier_mixer(opset, d), {"seq": seq})
    assert a.flops == {"int8": linear, "fp32": real + cplx} and not a.uncounted and a.covers() == 1.0
    assert a.nodes == {"int8": 1, "fp32": 2} and a.share()["fp32"] == round((real + cplx) / (linear + real + cplx), 4)


def test_a_short_time_fourier_transform_counts_an_fft_per_frame() -> None:
    """STFT: one FFT of the window's length per frame."""
    inits = [
        numpy_helper.from_array(np.array(8, np.int64), "step"),
        numpy_helper.from_array(np.hanning(16).astype(np.float32), "window"),
    ]
    g = helper.make_graph(
        [helper.make_node("STFT", ["x", "step", "window"], ["y"], onesided=1)],
        "stft",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64, 1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    a = audit_graph(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    frames = (64 - 16) // 8 + 1
    assert a.flops == {"fp32": frames * 2.5 * 16 * 4} and not a.uncounted


@pytest.mark.parametrize("equation", ["bqd,bkd->bqk", "...qd,...kd->...qk", "bqd, bkd -> bqk"])
def test_an_einsum_of_two_operands_counts_as_the_contraction_it_is(equation: str) -> None:
    """Two operands: 2 x the product of every index's size, a GEMM's 2 M N K (attention's q k^T written as one)."""
    seq, d = 12, 8
    g = helper.make_graph(
        [
            helper.make_node("Einsum", ["x", "x"], ["y"], equation=equation),
            helper.make_node("Einsum", ["x"], ["t"], equation="bqd->bdq"),
        ],
        "einsum",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", d])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None), helper.make_tensor_value_info("t", 1, None)],
    )
    a = audit_graph(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), {"seq": seq})
    assert a.flops == {"fp32": 2 * seq * seq * d} and a.nodes == {"fp32": 1}  # a transposition computes nothing


def test_compute_nodes_not_counted_are_named_with_their_op_and_precision() -> None:
    """An attention op (its FLOPs depend on heads and masks) and a MatMul inside a Loop's body (run as many times as
    the data says) cannot be counted per sample: ``uncounted_ops`` names them, beside the INT8 layer counted, and
    the share says it covers a third of the compute nodes."""
    d = 8
    inits = [numpy_helper.from_array(np.ones((d, 3 * d), np.float32), "wqkv")]
    nodes = [helper.make_node("Attention", ["x", "wqkv"], ["att"], domain="com.microsoft", num_heads=2)]
    qdq_linear(inits, nodes, "x", d, "y")
    body = helper.make_graph(
        [helper.make_node("MatMul", ["h", "wl"], ["h2"], name="inner")],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("c", TensorProto.BOOL, []),
            helper.make_tensor_value_info("h", TensorProto.FLOAT, [1, d]),
        ],
        [helper.make_tensor_value_info("c", TensorProto.BOOL, []), helper.make_tensor_value_info("h2", 1, [1, d])],
        [numpy_helper.from_array(np.ones((d, d), np.float32), "wl")],
    )
    inits.append(numpy_helper.from_array(np.ones((1, d), np.float32), "h0"))
    nodes.append(helper.make_node("Loop", ["n", "", "h0"], ["hn"], body=body))
    g = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, d]),
            helper.make_tensor_value_info("n", TensorProto.INT64, []),
        ],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in ("att", "y", "hn")],
        inits,
    )
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    record = audit_graph(model).record()
    assert record["uncounted_ops"] == {"Attention": {"fp32": 1}, "MatMul (in a Loop)": {"fp32": 1}}
    assert record["uncounted_nodes"] == {"fp32": 2} and record["share_covers_nodes"] == round(1 / 3, 4)
    assert record["share"] == {"int8": 1.0} and record["share_floor"]["int8"] < 0.5


@pytest.mark.parametrize("op, gates", [("LSTM", 4), ("GRU", 3), ("RNN", 1)])
def test_a_recurrent_layer_on_dequantized_weights_computes_in_float(op: str, gates: int) -> None:
    """ONNX Runtime's quantizer, given LSTM among its op types, writes DequantizeLinear -> LSTM: a float LSTM on
    dequantized weights (no runtime has a Q/DQ LSTM kernel). Beside a small INT8 head, the graph is mostly FP32,
    not "int8 100 %"; :meth:`Audit.elsewhere` names the LSTM as where the FLOPs outside INT8 are."""
    hidden, inputs = 16, 3
    inits = [
        numpy_helper.from_array(np.ones((1, gates * hidden, inputs), np.int8), "rnn_wq"),
        numpy_helper.from_array(np.ones((1, gates * hidden, hidden), np.int8), "rnn_rq"),
        numpy_helper.from_array(np.array(0.1, np.float32), "rnn_s"),
        numpy_helper.from_array(np.array(0, np.int8), "rnn_z"),
        numpy_helper.from_array(np.array([1], np.int64), "dirs"),
    ]
    nodes = [
        helper.make_node("DequantizeLinear", ["rnn_wq", "rnn_s", "rnn_z"], ["rnn_w"]),
        helper.make_node("DequantizeLinear", ["rnn_rq", "rnn_s", "rnn_z"], ["rnn_r"]),
        helper.make_node(op, ["x", "rnn_w", "rnn_r"], ["", "h"], name="rnn", hidden_size=hidden, layout=1),
        helper.make_node("Squeeze", ["h", "dirs"], ["h2"]),  # Y_h [batch, directions, hidden] -> [batch, hidden]
    ]
    qdq_linear(inits, nodes, "h2", hidden, "y")
    g = helper.make_graph(
        nodes,
        "rnn_head",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", inputs])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    a = audit_graph(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), {"seq": 24})
    assert a.nodes == {"fp32": 1, "int8": 1} and a.label() == "fp32"
    assert a.flops["fp32"] == 2 * 24 * gates * hidden * (inputs + hidden) and a.flops["int8"] == 2 * hidden * 16
    kept, by_op = a.elsewhere("int8")
    assert kept == 0 and list(by_op) == [op]
    assert a.elsewhere("int8", kept=["rnn"]) == (a.flops["fp32"], Counter())


def test_dynamically_quantized_lstm_layers_count_in_int8(tmp_path: Path) -> None:
    """ONNX Runtime's dynamic quantization of a 2-layer LSTM classifier writes DynamicQuantizeLSTM nodes, which
    onnx's shape inference has no rule for: each is INT8, and every node after the first (the second layer, the
    head) is counted too, at the FLOPs of the FP32 graph."""
    from onnxruntime.quantization import quantize_dynamic
    from torch import nn

    from tests.stages.precision.rnn_graphs import SEQ, rnn_classifier

    fp32, int8 = rnn_classifier(tmp_path / "lstm.onnx", nn.LSTM), tmp_path / "int8.onnx"
    quantize_dynamic(str(fp32), str(int8), op_types_to_quantize=["LSTM", "MatMul"])
    assert [n.op_type for n in onnx.load(int8).graph.node].count("DynamicQuantizeLSTM") == 2
    float_audit, a = audit_graph(fp32, {"seq": SEQ}), audit_graph(int8, {"seq": SEQ})
    assert a.flops == {"int8": float_audit.total} and not a.uncounted
    assert a.nodes == {"int8": 3} and a.label() == "int8"


def test_a_layer_kept_in_float_after_a_quantized_one_computes_in_float() -> None:
    """calibration.exclude_nodes keeps a conv in float: its input still arrives through the Q/DQ pair of the layer
    before, its weight is a plain float. It runs in float; it was counted INT8, and an engine whose big layer was
    kept in float was labelled 99.99 % INT8 and built."""
    inits = [
        numpy_helper.from_array(np.array(0.1, np.float32), "s"),
        numpy_helper.from_array(np.array(0, np.int8), "z"),
        numpy_helper.from_array(np.ones((4, 3, 3, 3), np.int8), "w1q"),
        numpy_helper.from_array(np.ones((64, 4, 3, 3), np.float32), "w2"),  # the big layer, kept in float
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["img", "s", "z"], ["iq"]),
        helper.make_node("DequantizeLinear", ["iq", "s", "z"], ["idq"]),
        helper.make_node("DequantizeLinear", ["w1q", "s", "z"], ["w1"]),
        helper.make_node("Conv", ["idq", "w1"], ["c1"], name="conv_int8", pads=[1, 1, 1, 1]),
        helper.make_node("QuantizeLinear", ["c1", "s", "z"], ["c1q"]),
        helper.make_node("DequantizeLinear", ["c1q", "s", "z"], ["c1dq"]),
        helper.make_node("Conv", ["c1dq", "w2"], ["y"], name="conv_kept", pads=[1, 1, 1, 1]),
    ]
    g = helper.make_graph(
        nodes,
        "kept",
        [helper.make_tensor_value_info("img", TensorProto.FLOAT, ["batch", 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    a = audit_graph(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    assert a.nodes == {"int8": 1, "fp32": 1}
    assert a.by_node["conv_kept"][1] == "fp32" and a.by_node["conv_int8"][1] == "int8"
    assert a.label() == "fp32" and a.share()["fp32"] > 0.9


def test_symbolic_shape_inference_loads_no_torch() -> None:
    """ONNX Runtime's symbolic shape inference comes by a path that does not import torch: a file's audit (each
    ``kiln build``) would otherwise spend seconds loading it."""
    code = (
        "import sys; from kiln.stages.precision import audit; "
        "from tests.stages.precision.test_audit import attention; "
        "shapes = audit._symbolic_shapes(attention(8)); "
        "assert shapes, 'no shapes'; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parents[3])
    assert done.returncode == 0, done.stderr[-2000:]
