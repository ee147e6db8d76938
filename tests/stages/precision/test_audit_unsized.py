"""An INT8 graph whose float compute nodes come after a Loop (a DLRM's EmbeddingBag tables): shape inference gives
them no shapes, so they are not counted, and the audit's refusal leads with what it knows for certain (how many
compute nodes run in which precision, which ones could not be sized), not with the share of the nodes it counted."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from pytest import MonkeyPatch

from kiln.core.errors import ModelError
from kiln.stages.precision import audit
from kiln.stages.precision.audit import audit_graph, doubt_fix, label_problem

D = 8


def _int8_linear(x: str, name: str, nodes: list[onnx.NodeProto], inits: list[onnx.TensorProto]) -> str:
    """``x`` [batch, D] through ONNX Runtime's dynamic INT8 pattern: DynamicQuantizeLinear -> MatMulInteger."""
    inits += [
        numpy_helper.from_array(np.ones((D, D), np.int8), f"{name}_w"),
        numpy_helper.from_array(np.array(0, np.int8), f"{name}_wz"),
    ]
    nodes += [
        helper.make_node("DynamicQuantizeLinear", [x], [f"{name}_q", f"{name}_s", f"{name}_z"], name=f"{name}_dq"),
        helper.make_node("MatMulInteger", [f"{name}_q", f"{name}_w", f"{name}_z", f"{name}_wz"], [f"{name}_i"]),
        helper.make_node("Cast", [f"{name}_i"], [f"{name}_y"], to=TensorProto.FLOAT, name=f"{name}_cast"),
    ]
    nodes[-2].name = name
    return f"{name}_y"


def dlrm_like() -> onnx.ModelProto:
    """Two INT8 MatMulInteger layers (sized), a Loop slicing rows of their output one per iteration (an
    EmbeddingBag's export: its output's shape is unknown), then three FP32 MatMuls on it (kept in float)."""
    nodes: list[onnx.NodeProto] = []
    inits = [numpy_helper.from_array(np.ones((D, D), np.float32), f"w{i}") for i in (3, 4)]
    inits += [numpy_helper.from_array(np.array(2, np.int64), "trips")]
    inits += [numpy_helper.from_array(np.array([1], np.int64), "one")]
    bottom = _int8_linear(_int8_linear("x", "bottom1", nodes, inits), "bottom2", nodes, inits)
    body = helper.make_graph(
        [
            helper.make_node("Unsqueeze", ["i", "zero"], ["start"]),
            helper.make_node("Add", ["start", "one"], ["end"]),
            helper.make_node("Slice", [bottom, "start", "end", "zero"], ["row"]),
            helper.make_node("Identity", ["cond"], ["cond_out"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("row", TensorProto.FLOAT, ["rows", D]),
        ],
        [numpy_helper.from_array(np.array([0], np.int64), "zero")],
    )
    nodes += [
        helper.make_node("Loop", ["trips", ""], ["rows"], body=body, name="bag"),
        helper.make_node("MatMul", ["rows", "w3"], ["t1"], name="top1"),
        helper.make_node("MatMul", ["t1", "w4"], ["t2"], name="top2"),
        helper.make_node("Transpose", ["t2"], ["t2t"], perm=[0, 2, 1], name="tr"),
        helper.make_node("MatMul", ["t2", "t2t"], ["y"], name="interaction"),
    ]
    g = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", D])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["trips", "rows", "rows"])],
        inits,
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_float_nodes_after_a_loop_lead_the_refusal_with_what_is_certain() -> None:
    record = audit_graph(dlrm_like()).record()
    assert record["compute_nodes"] == {"int8": 2, "fp32": 3} and record["share"] == {"int8": 1.0}
    assert record["uncounted_ops"] == {"MatMul (after a Loop)": {"fp32": 3}}
    problem = label_problem(record, "int8")
    assert problem is not None and "100%" not in problem.split(":")[0]  # no "int8 100%" headline
    assert problem.startswith(
        "labelled int8, 2 of its 5 compute nodes run in int8 and 3 in fp32 could not be sized (MatMul x3 after a Loop)"
    )
    assert "as little as 40% with those 3" in problem


def test_the_fix_for_a_label_in_doubt_names_the_settings_of_that_precision() -> None:
    """FP16 chooses its float nodes by precision.fp16's settings, INT8 and FP8 by calibration's."""
    record = {"share": {"fp16": 0.9, "int8": 0.9, "fp8": 0.9}, "share_floor": {"fp16": 0.3, "int8": 0.3, "fp8": 0.3}}
    fp16 = doubt_fix(record, "fp16") or ""
    assert "precision.fp16.fp32_ops" in fp16 and "precision.fp16.fp32_nodes" in fp16 and "calibration" not in fp16
    for label in ("int8", "fp8"):
        fix = doubt_fix(record, label) or ""
        assert "calibration.op_types" in fix and "calibration.exclude_nodes" in fix and "fp32_ops" not in fix


def _data_sized(x: str, name: str, nodes: list[onnx.NodeProto], inits: list[onnx.TensorProto]) -> str:
    """An FP32 MatMul of the columns of ``x`` [batch, D] that are 0 in its first row (NonZero: a count only the
    data gives) by their transpose: neither shape inference sizes it, one ONNX Runtime run (on zeros: every column)
    does."""
    inits += [
        numpy_helper.from_array(np.array(0, np.int64), f"{name}_first"),
        numpy_helper.from_array(np.array(0, np.float32), f"{name}_zero"),
        numpy_helper.from_array(np.array([0], np.int64), f"{name}_axis"),
    ]
    nodes += [
        helper.make_node("Gather", [x, f"{name}_first"], [f"{name}_row"], axis=0),
        helper.make_node("Equal", [f"{name}_row", f"{name}_zero"], [f"{name}_mask"]),
        helper.make_node("NonZero", [f"{name}_mask"], [f"{name}_at"]),
        helper.make_node("Squeeze", [f"{name}_at", f"{name}_axis"], [f"{name}_picked"]),
        helper.make_node("Gather", [x, f"{name}_picked"], [f"{name}_x"], axis=1),
        helper.make_node("Transpose", [f"{name}_x"], [f"{name}_xt"]),
        helper.make_node("MatMul", [f"{name}_x", f"{name}_xt"], [f"{name}_y"], name=name),
    ]
    return f"{name}_y"


def _graph(int8: bool) -> onnx.ModelProto:
    """Two small FP32 MatMuls shape inference cannot size, beside one INT8 layer (``int8``) or one FP32 MatMul."""
    nodes: list[onnx.NodeProto] = []
    inits = [numpy_helper.from_array(np.ones((D, D), np.float32), "w")]
    if int8:
        y = _int8_linear("x", "layer", nodes, inits)
    else:
        nodes.append(helper.make_node("MatMul", ["x", "w"], ["y"], name="layer"))
        y = "y"
    outs = [y, _data_sized("x", "small1", nodes, inits), _data_sized("x", "small2", nodes, inits)]
    g = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", D])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs],
        inits,
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _runs(monkeypatch: MonkeyPatch) -> list[list[str]]:
    """The ONNX Runtime runs the audit makes to size nodes, by the tensors each sizes."""
    runs: list[list[str]] = []
    real = audit._run_shapes
    monkeypatch.setattr(
        audit, "_run_shapes", lambda model, pinned, names: runs.append(names) or real(model, pinned, names)
    )
    return runs


def test_an_fp32_input_with_only_fp32_nodes_unsized_is_taken_without_running(monkeypatch: MonkeyPatch) -> None:
    """Sizing FP32 nodes cannot make an FP32 graph low: the input is taken without loading it into ONNX Runtime."""
    runs = _runs(monkeypatch)
    assert audit_graph(_graph(int8=False), run=False).uncounted == {"fp32": 2}
    audit.refuse_low_precision(_graph(int8=False), "m.onnx", "kiln precision")
    assert runs == []


def test_an_input_whose_label_only_unsized_nodes_put_in_doubt_is_sized_and_refused(monkeypatch: MonkeyPatch) -> None:
    """Unsized, the FP32 nodes weigh as the INT8 layer each (its floor 33%); sized by one run they are small."""
    runs = _runs(monkeypatch)
    assert audit.in_doubt(audit_graph(_graph(int8=True), run=False).record(), "int8")
    with pytest.raises(ModelError, match="m.onnx is already INT8"):
        audit.refuse_low_precision(_graph(int8=True), "m.onnx", "kiln precision")
    assert len(runs) == 1


def test_symbolic_shape_inference_keeps_its_own_warnings_to_itself(caplog) -> None:
    """ORT's symbolic shape inference warns when it cannot tell an index's sign (a Slice starting at seq/4 - 1):
    arithmetic of the helper the audit counts with, nothing the user can act on."""
    import logging

    from onnx import TensorProto, helper

    from kiln.stages.precision.audit import _symbolic_shapes

    consts = {"one": 1, "four": 4, "big": 1000}
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "one"], ["L"], axis=0),
        helper.make_node("Div", ["L", "four"], ["q"]),
        helper.make_node("Sub", ["q", "one"], ["start"]),
        helper.make_node("Slice", ["x", "start", "big", "one"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "seq"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [helper.make_tensor(k, TensorProto.INT64, [1], [v]) for k, v in consts.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with caplog.at_level(logging.WARNING):
        shapes = _symbolic_shapes(model)
    assert shapes["start"] == [1]  # it ran
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert logging.getLogger("onnxruntime.tools.symbolic_shape_infer").level == logging.NOTSET  # level restored
