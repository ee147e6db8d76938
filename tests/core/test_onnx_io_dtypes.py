"""kiln.core.onnx_io.infer_shapes: a failed type check names the input's dtype and its cast, not the shapes."""

from __future__ import annotations

import onnx
import pytest
from onnx import TensorProto, helper

from kiln.core.errors import ModelError
from kiln.core.onnx_io import infer_shapes


def _scatter(index_type: int) -> onnx.ModelProto:
    """``data[idx] = upd`` as ScatterND, the way torch's index_add_/index_put_ exports, with ``idx`` of a dtype."""
    node = helper.make_node("ScatterND", ["data", "edge_index", "upd"], ["y"], name="scatter")
    graph = helper.make_graph(
        [node],
        "g",
        [
            helper.make_tensor_value_info("data", TensorProto.FLOAT, [4, 3]),
            helper.make_tensor_value_info("edge_index", index_type, [2, 1]),
            helper.make_tensor_value_info("upd", TensorProto.FLOAT, [2, 3]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 3])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_int32_indices_name_the_input_and_the_cast() -> None:
    with pytest.raises(ModelError) as err:
        infer_shapes(_scatter(TensorProto.INT32))
    assert "unsupported type: tensor(int32)" in err.value.message
    assert "'edge_index' is int32" in err.value.hint and ".long()" in err.value.hint
    assert "shape mismatch" not in err.value.hint


def test_int64_indices_pass() -> None:
    infer_shapes(_scatter(TensorProto.INT64))
