"""index_floors: the smallest value of an input that indexes an axis of no size in the graph."""

from __future__ import annotations

from onnx import TensorProto, helper

from kiln.core.onnx_io import index_floors, index_ranges
from tests.core.test_index_ranges import _const, _gin_graph, _model


def test_an_edge_index_into_a_dynamic_node_axis_starts_at_0() -> None:
    """index_select/gather/index_add_ over a dynamic number of nodes: no range (the call's data sets the end), but
    ONNX would take -1 as the last node where torch refuses it, so the floor is 0."""
    graph = _gin_graph(nodes_axis="nodes")
    assert index_ranges(graph) == {}
    assert index_floors(graph) == {"edge_index": 0}


def test_an_input_with_a_range_gets_no_floor() -> None:
    assert index_floors(_gin_graph()) == {}


def test_a_shifted_index_and_an_unindexing_input_into_a_dynamic_axis() -> None:
    """``h.index_select(1, ids - 1)``: ids start at 1; an input that reaches no index op (``other``) has none, nor
    does a 1-D lookup of constants."""
    nodes = [
        helper.make_node("Relu", ["x"], ["h"]),
        _const("one", 1),
        helper.make_node("Sub", ["ids", "one"], ["shifted"]),
        helper.make_node("Gather", ["h", "shifted"], ["y"], axis=1),
        helper.make_node("Add", ["other", "one"], ["z"]),
        helper.make_node("Gather", ["flat", "pick"], ["w"]),
    ]
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "n", 4]),
        helper.make_tensor_value_info("ids", TensorProto.INT64, [5]),
        helper.make_tensor_value_info("other", TensorProto.INT64, [5]),
        helper.make_tensor_value_info("flat", TensorProto.FLOAT, ["n"]),
        helper.make_tensor_value_info("pick", TensorProto.INT64, [2]),
    ]
    assert index_floors(_model(nodes, inputs, ["y", "z", "w"])) == {"ids": 1}
