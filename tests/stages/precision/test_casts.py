"""remove_cast_chains on graphs an exporter writes: a Constant of an empty list attribute survives the rewrite."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import AttributeProto, TensorProto, helper

from kiln.stages.precision.casts import remove_cast_chains


def _empty_list_constant_graph() -> onnx.ModelProto:
    """x -> Cast(FP16) -> Cast(FP32) -> Reshape to the shape of an empty ``value_ints`` Constant (a scalar)."""
    shape = helper.make_node("Constant", [], ["shape"], name="empty_shape")
    shape.attribute.append(helper.make_attribute("value_ints", [], attr_type=AttributeProto.INTS))
    nodes = [
        shape,
        helper.make_node("Cast", ["x"], ["h"], name="to_half", to=TensorProto.FLOAT16),
        helper.make_node("Cast", ["h"], ["f"], name="to_float", to=TensorProto.FLOAT),
        helper.make_node("Reshape", ["f", "shape"], ["y"], name="reshape"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_empty_list_constant_is_written_back() -> None:
    out, removed = remove_cast_chains(_empty_list_constant_graph())
    onnx.checker.check_model(out)
    assert removed > 0 and not any(n.op_type == "Cast" for n in out.graph.node)
    sess = ort.InferenceSession(out.SerializeToString(), providers=["CPUExecutionProvider"])
    (y,) = sess.run(None, {"x": np.array([1.5], np.float32)})
    assert y.shape == () and y == np.float32(1.5)
