"""An INT8 graph whose float compute nodes come after a Loop (a DLRM's EmbeddingBag tables): shape inference gives
them no shapes, so they are not counted, and the audit's refusal leads with what it knows for certain (how many
compute nodes run in which precision, which ones could not be sized), not with the share of the nodes it counted."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kiln.stages.precision.audit import audit_graph, label_problem

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
