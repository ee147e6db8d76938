"""kiln.core.onnx_io.index_ranges of values a graph makes into indices: a float input cast to an integer (a diffusion
model's timestep, ``emb(t.long())``), and an input concatenated with a tensor filled with a constant
(classifier-free guidance's null class, ``torch.cat([y, torch.full_like(y, k)])``)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from kiln.core.onnx_io import index_ranges, outside_index

INT64, FLOAT = onnx.TensorProto.INT64, onnx.TensorProto.FLOAT


def _model(nodes: list, inputs: list, rows: int) -> onnx.ModelProto:
    table = numpy_helper.from_array(np.zeros((rows, 4), np.float32), "table")
    out = helper.make_tensor_value_info("emb", FLOAT, None)
    graph = helper.make_graph(nodes, "g", inputs, [out], [table])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _timestep_graph(rows: int = 1000) -> onnx.ModelProto:
    """``table[t.long()]``, as the exporters write it: t float [batch] -> Cast -> Gather over a [rows, 4] table."""
    nodes = [
        helper.make_node("Cast", ["t"], ["t_int"], to=INT64),
        helper.make_node("Gather", ["table", "t_int"], ["emb"]),
    ]
    return _model(nodes, [helper.make_tensor_value_info("t", FLOAT, ["batch"])], rows)


def test_a_float_input_cast_to_an_index_takes_the_tables_rows() -> None:
    model = _timestep_graph()
    assert index_ranges(model) == {"t": [0, 999]}
    assert "input 't' holds 5000" in outside_index(model, {"t": np.array([5000.0], np.float32)}, "m")
    assert outside_index(model, {"t": np.array([0.0, 999.9], np.float32)}, "m") is None  # truncated as Cast does


def test_a_float_input_cast_to_a_narrow_integer_gets_no_range() -> None:
    """A narrower integer wraps the values: no index of the table's rows, as for an integer input."""
    nodes = [
        helper.make_node("Cast", ["t"], ["t16"], to=onnx.TensorProto.INT16),
        helper.make_node("Cast", ["t16"], ["t_int"], to=INT64),
        helper.make_node("Gather", ["table", "t_int"], ["emb"]),
    ]
    assert index_ranges(_model(nodes, [helper.make_tensor_value_info("t", FLOAT, ["batch"])], 1000)) == {}


def _guidance_graph(fill: int = 4, rows: int = 5, expand: bool = False) -> onnx.ModelProto:
    """``cemb(torch.cat([y, torch.full_like(y, fill)]))`` as torch.onnx.export writes it: Shape(y) ->
    ConstantOfShape(fill) (or an Expand of a constant ``fill`` to that shape) -> Concat(y, it) -> Gather."""
    value = numpy_helper.from_array(np.array([fill], np.int64), "v")
    filled = (
        [
            helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.array(fill, np.int64), "c")),
            helper.make_node("Expand", ["c", "shape"], ["null"]),
        ]
        if expand
        else [helper.make_node("ConstantOfShape", ["shape"], ["null"], value=value)]
    )
    nodes = [
        helper.make_node("Shape", ["y"], ["shape"]),
        *filled,
        helper.make_node("Concat", ["y", "null"], ["both"], axis=0),
        helper.make_node("Gather", ["table", "both"], ["emb"]),
    ]
    return _model(nodes, [helper.make_tensor_value_info("y", INT64, ["batch"])], rows)


@pytest.mark.parametrize("expand", [False, True])
def test_an_input_concatenated_with_a_filled_constant_keeps_the_tables_rows(expand: bool) -> None:
    model = _guidance_graph(expand=expand)
    assert index_ranges(model) == {"y": [0, 4]}
    assert "input 'y' holds 7" in outside_index(model, {"y": np.array([1, 7])}, "m")


def test_a_filled_constant_past_the_table_leaves_the_input_without_range() -> None:
    """The concatenated values' meaning holds within the table only, as for literal constants."""
    assert index_ranges(_guidance_graph(fill=5)) == {}
