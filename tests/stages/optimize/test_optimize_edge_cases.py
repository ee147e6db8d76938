"""Edge cases where a rewrite touches a graph output or a tensor with several readers: the pass must still
fire (run_pass fails on a rollback) and the result must be a valid graph with the interface names kept."""

from __future__ import annotations

import onnx
from onnx import helper as h

from tests.stages.optimize.optimize_helpers import FLOAT, f32, make_model, ops, run_pass


def _valid(model: onnx.ModelProto) -> None:
    onnx.checker.check_model(model, full_check=True)
    assert [o.name for o in model.graph.output] == ["y", "z"]


def test_identity_to_graph_output_whose_input_has_other_readers():
    m = make_model(
        [
            h.make_node("Relu", ["x"], ["r"]),
            h.make_node("Identity", ["r"], ["y"]),
            h.make_node("Sigmoid", ["r"], ["z"]),
        ],
        [("x", ["N", 3], FLOAT)],
        ["y", "z"],
        {},
    )
    out, _ = run_pass(m, "eliminate_identity")
    _valid(out)
    assert ops(out) == ["Relu", "Sigmoid"]


def test_transposes_vanish_into_graph_output_while_first_is_read_elsewhere():
    m = make_model(
        [
            h.make_node("Relu", ["x"], ["r"]),
            h.make_node("Transpose", ["r"], ["t"], perm=[1, 0]),
            h.make_node("Transpose", ["t"], ["y"], perm=[1, 0]),
            h.make_node("Sigmoid", ["t"], ["z"]),
        ],
        [("x", [2, 3], FLOAT)],
        ["y", "z"],
        {},
    )
    out, _ = run_pass(m, "merge_transposes")
    _valid(out)
    assert ops(out) == ["Relu", "Transpose", "Sigmoid"]


def test_conv_add_of_a_one_element_constant_that_adds_an_axis_is_not_a_bias():
    m = make_model(
        [h.make_node("Conv", ["x", "w"], ["c"]), h.make_node("Add", ["c", "k"], ["y"])],
        [("x", ["N", 3, 4, 4], FLOAT)],
        ["y"],
        {"w": f32(5, 3, 1, 1), "k": f32(1, 1, 1, 1, 1)},
    )
    out, s = run_pass(m, "fold_conv_add")  # folding would drop the output's fifth axis
    assert ops(out) == ["Conv", "Add"] and s["passes"][0]["changes"] == 0


def test_safety_net_rejects_moved_infinities() -> None:
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    from kiln.stages.optimize.config import OptimizeConfig
    from kiln.stages.optimize.verify import Verifier

    def divide_by(divisor: list[float]) -> onnx.ModelProto:
        graph = helper.make_graph(
            [helper.make_node("Div", ["x", "c"], ["y"])],
            "div",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
            [numpy_helper.from_array(np.array(divisor, dtype=np.float32), "c")],
        )
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])

    verifier = Verifier(divide_by([1.0, 0.0]), OptimizeConfig())  # the reference has an inf in its second output
    assert verifier.check(divide_by([1.0, 0.0])).ok
    verdict = verifier.check(divide_by([1.0, 1.0]))  # finite where the reference was inf
    assert not verdict.ok and "infinities" in verdict.reason
