"""What the precision audit reaches: a DequantizeLinear through a Cast to float16, compute nodes in a Loop's body
(as many times as it runs), an Einsum of any number of operands, and a DFT whose length is computed from the
input's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.stages.precision import audit as audit_module
from kiln.stages.precision.audit import MIN_SHARE, audit_graph, engine_audit, in_doubt, label_problem

OPSET = [helper.make_opsetid("", 17)]
H = 8


def _dq(inits: list[onnx.TensorProto], nodes: list[onnx.NodeProto], name: str, shape: tuple[int, ...]) -> str:
    """An INT8 weight ``name`` of ``shape`` through a DequantizeLinear: its float output's name."""
    inits += [
        numpy_helper.from_array(np.ones(shape, np.int8), f"{name}_q"),
        numpy_helper.from_array(np.array(0.1, np.float32), f"{name}_s"),
        numpy_helper.from_array(np.array(0, np.int8), f"{name}_z"),
    ]
    nodes.append(helper.make_node("DequantizeLinear", [f"{name}_q", f"{name}_s", f"{name}_z"], [f"{name}_dq"]))
    return f"{name}_dq"


def _qat_conv(cast: bool) -> onnx.ModelProto:
    """A QAT export's Conv on Q/DQ input and weight; ``cast``: as the FP16 conversion leaves it, each
    DequantizeLinear's output cast to float16 before the Conv."""
    inits = [
        numpy_helper.from_array(np.array(0.1, np.float32), "xs"),
        numpy_helper.from_array(np.array(0, np.int8), "xz"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["x_dq"]),
    ]
    operands = ["x_dq", _dq(inits, nodes, "w", (4, 3, 3, 3))]
    if cast:
        nodes += [helper.make_node("Cast", [o], [f"{o}16"], to=TensorProto.FLOAT16) for o in operands]
        operands = [f"{o}16" for o in operands]
    nodes.append(helper.make_node("Conv", operands, ["y"], name="conv", pads=[1, 1, 1, 1]))
    out_type = TensorProto.FLOAT16 if cast else TensorProto.FLOAT
    g = helper.make_graph(
        nodes,
        "qat",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 6, 6])],
        [helper.make_tensor_value_info("y", out_type, None)],
        inits,
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)])


@pytest.mark.parametrize("cast", [False, True])
def test_a_dequantized_operand_cast_to_float16_is_still_int8(cast: bool) -> None:
    """DequantizeLinear -> Cast(float16) -> Conv computes on the quantized values, as without the Cast: the graph
    is INT8, and an engine built from it labelled fp16 is refused."""
    record = audit_graph(_qat_conv(cast)).record()
    assert record["share"] == {"int8": 1.0}
    assert label_problem(record, "fp16") is not None and label_problem(record, "int8") is None


def _rnn_loop(trips: str) -> onnx.ModelProto:
    """x [batch, T, 4] -> a Loop over its steps: h = tanh(x_t W + h), W FP32 in the body; after it, an INT8 head
    on every step's h (a ConcatFromSequence: sized by the data, so counted by no FLOPs). ``trips``: "shape" (the
    trip count is T, from x's shape) or "input" (a graph input: the data's)."""
    inits: list[onnx.TensorProto] = [numpy_helper.from_array(np.array([0], np.int64), "ax0")]
    nodes: list[onnx.NodeProto] = []
    head = _dq(inits, nodes, "head", (H, 3))
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["c"], ["co"]),
            helper.make_node("Gather", ["xT", "i"], ["xt"], axis=0),
            helper.make_node("MatMul", ["xt", "W"], ["a"], name="step_mm"),
            helper.make_node("Add", ["a", "hs"], ["s"]),
            helper.make_node("Tanh", ["s"], ["ho"]),
            helper.make_node("SequenceInsert", ["seq_in", "ho"], ["seq_out"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("c", TensorProto.BOOL, []),
            helper.make_tensor_value_info("hs", TensorProto.FLOAT, ["batch", H]),
            helper.make_tensor_sequence_value_info("seq_in", TensorProto.FLOAT, ["batch", H]),
        ],
        [
            helper.make_tensor_value_info("co", TensorProto.BOOL, []),
            helper.make_tensor_value_info("ho", TensorProto.FLOAT, ["batch", H]),
            helper.make_tensor_sequence_value_info("seq_out", TensorProto.FLOAT, ["batch", H]),
        ],
        [numpy_helper.from_array(np.ones((4, H), np.float32), "W")],
    )
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "T", 4])]
    if trips == "input":
        inputs.append(helper.make_tensor_value_info("steps", TensorProto.INT64, []))
    else:
        nodes += [
            helper.make_node("Shape", ["x"], ["t1"], start=1, end=2),
            helper.make_node("Squeeze", ["t1", "ax0"], ["steps"]),
        ]
    inits.append(numpy_helper.from_array(np.zeros((1, H), np.float32), "h0"))
    nodes += [
        helper.make_node("Transpose", ["x"], ["xT"], perm=[1, 0, 2]),
        helper.make_node("SequenceEmpty", [], ["s0"], dtype=TensorProto.FLOAT),
        helper.make_node("Loop", ["steps", "", "h0", "s0"], ["hT", "seqT"], body=body),
        helper.make_node("ConcatFromSequence", ["seqT"], ["hid"], axis=1, new_axis=1),
        helper.make_node("MatMul", ["hid", head], ["y"], name="head_mm"),
    ]
    g = helper.make_graph(nodes, "rnn", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(g, opset_imports=OPSET)


def test_a_loop_body_weighs_as_often_as_it_runs(tmp_path: Path) -> None:
    """No FLOPs are counted (the body's and the head's shapes are the data's): the share is of the compute nodes'
    runs, the body's FP32 MatMul once per step (T=6 from the input's shape) against the INT8 head once. Not
    "int8 50 %"; and the engine audit does not say it is by FLOPs."""
    audit = audit_graph(_rnn_loop("shape"), {"T": 6})
    assert audit.total == 0 and audit.share() == {"int8": round(1 / 7, 4), "fp32": round(6 / 7, 4)}
    assert audit.label() == "fp32" and label_problem(audit.record(), "int8") is not None
    onnx.save(_rnn_loop("shape"), tmp_path / "m.onnx")
    engine = engine_audit(tmp_path / "m.onnx", tmp_path / "m.onnx", {"T": 6})
    assert engine["method"] == "source graph by compute node (no FLOPs counted), checked against the engine graph"
    assert label_problem(engine, "int8") is not None


def test_a_loop_of_unknown_trip_count_puts_a_low_label_in_doubt(tmp_path: Path) -> None:
    """The trip count is a graph input: the body's FP32 MatMul may run any number of times, so the INT8 head's
    share (50 % of the nodes) has no floor above 0: in doubt, refused. The engine audit says it is by compute
    node, not by FLOPs."""
    record = audit_graph(_rnn_loop("input"), {"T": 6}).record()
    assert record["share"] == {"int8": 0.5, "fp32": 0.5} and record["share_floor"]["int8"] == 0.0
    assert record["trips_unknown"] == {"fp32": 1} and in_doubt(record, "int8")
    problem = label_problem(record, "int8") or ""
    assert "as many times as the data says" in problem and "of the FLOPs counted" not in problem
    onnx.save(_rnn_loop("input"), tmp_path / "m.onnx")
    engine = engine_audit(tmp_path / "m.onnx", None, {"T": 6})
    assert engine["method"] == "source graph, by compute node (no FLOPs counted)"


def test_a_counted_graph_weighs_a_loop_body_by_its_trip_count() -> None:
    """An INT8 layer counted (128 FLOPs) beside a Loop of 3 trips whose body holds an FP32 MatMul not counted: the
    body weighs as the largest counted node at each of its 3 runs, not once (which would leave INT8 its 50 %)."""
    inits: list[onnx.TensorProto] = [numpy_helper.from_array(np.array(3, np.int64), "three")]
    nodes: list[onnx.NodeProto] = []
    nodes.append(helper.make_node("MatMul", ["x", _dq(inits, nodes, "w", (H, H))], ["y"], name="layer"))
    body = helper.make_graph(
        [helper.make_node("Identity", ["c"], ["co"]), helper.make_node("MatMul", ["h", "U"], ["h2"], name="inner")],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("c", TensorProto.BOOL, []),
            helper.make_tensor_value_info("h", TensorProto.FLOAT, None),
        ],
        [helper.make_tensor_value_info("co", TensorProto.BOOL, []), helper.make_tensor_value_info("h2", 1, None)],
        [numpy_helper.from_array(np.ones((H, H), np.float32), "U")],
    )
    model = _with_loop(inits, nodes, body)
    audit = audit_graph(model)
    assert audit.flops == {"int8": 2 * H * H} and audit.runs() == {"fp32": 3}
    assert audit.floor() == {"int8": 0.25} and audit.label() == "fp32"


def _with_loop(inits: list[onnx.TensorProto], nodes: list[onnx.NodeProto], body: onnx.GraphProto) -> onnx.ModelProto:
    """``nodes`` on x [batch, H] and a Loop of ``three`` trips running ``body`` on y, its condition constant."""
    inits.append(numpy_helper.from_array(np.array(True), "true"))
    nodes.append(helper.make_node("Loop", ["three", "true", "y"], ["hn"], body=body))
    g = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", H])],
        [helper.make_tensor_value_info("hn", TensorProto.FLOAT, None)],
        inits,
    )
    return helper.make_model(g, opset_imports=OPSET)


def test_an_einsum_of_four_operands_counts_its_cheapest_contraction_order() -> None:
    """``einsum("bld,de,ef,fg->blg")`` in FP32 after an INT8 layer: counted (the cheapest order: e f g first, then
    d, then b l), so its FLOPs weigh against the INT8 layer's and the graph is not "int8 100 %"."""
    seq, d, g = 32, 16, 8
    inits = [
        numpy_helper.from_array(np.ones(s, np.float32), n) for n, s in (("A", (d, d)), ("B", (d, d)), ("C", (d, g)))
    ]
    nodes: list[onnx.NodeProto] = []
    nodes.append(helper.make_node("MatMul", ["x", _dq(inits, nodes, "w", (4, d))], ["h"], name="inp"))
    nodes.append(helper.make_node("Einsum", ["h", "A", "B", "C"], ["y"], equation="bld,de,ef,fg->blg"))
    graph = helper.make_graph(
        nodes,
        "einsum4",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    audit = audit_graph(helper.make_model(graph, opset_imports=OPSET), {"seq": seq})
    einsum = 2 * d * d * g + 2 * d * d * g + 2 * seq * d * g  # (B C), then A (B C), then h (A B C)
    assert audit.flops == {"int8": 2 * seq * 4 * d, "fp32": einsum} and not audit.uncounted
    assert audit.share()["int8"] < MIN_SHARE and audit.label() == "fp32"


@pytest.mark.parametrize(
    "equation, shapes, flops",
    [
        ("...d,de,ef->...f", [(2, 3, 4), (4, 5), (5, 6)], 2 * 4 * 5 * 6 + 2 * 6 * 4 * 6),  # (de ef) first
        ("ij,jk,kl", [(2, 3), (3, 4), (4, 5)], 2 * 2 * 3 * 4 + 2 * 2 * 4 * 5),  # implicit output: il
    ],
)
def test_an_einsum_with_broadcast_axes_or_an_implicit_output(equation: str, shapes: list, flops: int) -> None:
    names = [f"x{i}" for i in range(len(shapes))]
    graph = helper.make_graph(
        [helper.make_node("Einsum", names, ["y"], equation=equation)],
        "e",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in zip(names, shapes)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    assert audit_graph(helper.make_model(graph, opset_imports=OPSET)).flops == {"fp32": flops}


@pytest.mark.parametrize("read", ["input", "range"])
def test_a_dft_length_computed_from_the_input_shape_is_folded_at_the_sizes_given(
    read: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real FFT of length 2 x seq (torch.fft.rfft(v, n=2 * L) on a dynamic L): the length is no constant, but
    Shape -> Mul; at seq 32 it is 64. ``read``: from the input's shape (folded with no run of the graph), or from
    the shape of a Range of that length (which, without ORT's symbolic inference, only the run sizes)."""
    seq = 32
    inits = [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in (("two", 2), ("zero", 0), ("one", 1))]
    inits.append(numpy_helper.from_array(np.array([0], np.int64), "ax0"))
    nodes = [
        helper.make_node("Shape", ["x"], ["len1"], start=1, end=2),
        helper.make_node("Squeeze", ["len1", "ax0"], ["length"]),
        helper.make_node("Mul", ["length", "two"], ["n" if read == "input" else "n2"]),
    ]
    if read == "range":
        nodes += [
            helper.make_node("Range", ["zero", "n2", "one"], ["steps"]),
            helper.make_node("Shape", ["steps"], ["n1"]),
            helper.make_node("Squeeze", ["n1", "ax0"], ["n"]),
        ]
        monkeypatch.setattr(audit_module, "_symbolic_shapes", lambda model: {})
    else:
        monkeypatch.setattr(audit_module, "_run_shapes", lambda model, pinned, names: pytest.fail(str(names)))
    nodes.append(helper.make_node("DFT", ["x", "n"], ["y"], name="rfft", axis=1, onesided=1))
    graph = helper.make_graph(
        nodes,
        "rfft",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    audit = audit_graph(helper.make_model(graph, opset_imports=OPSET), {"seq": seq})
    n = 2 * seq
    assert audit.flops == {"fp32": round(2.5 * n * np.log2(n))} and not audit.uncounted_ops


def test_a_dft_length_read_from_the_data_is_not_folded() -> None:
    """A length computed from an input's values (not its shape) is the data's: the run's made-up inputs do not give
    it, and the DFT stays uncounted."""
    graph = helper.make_graph(
        [helper.make_node("DFT", ["x", "n"], ["y"], axis=1)],
        "dft",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16, 1]),
            helper.make_tensor_value_info("n", TensorProto.INT64, []),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    assert audit_graph(helper.make_model(graph, opset_imports=OPSET)).uncounted_ops == {"DFT": {"fp32": 1}}
