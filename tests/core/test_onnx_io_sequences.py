"""kiln.core.onnx_io.infer_shapes: the elements of a sequence of tensors of different sizes keep no shared size
name, which ONNX Runtime would trust to reuse one buffer for both."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kiln.core.onnx_io import infer_shapes, ort_run, ort_session


def split_weight_model() -> onnx.ModelProto:
    """A [96, 32] weight split into a sequence of [32, 32] and [64, 32] (a cross-attention's q and kv rows), each
    part multiplied by the input; the [64, 32] part is read and freed first, so ORT may give the other its buffer."""
    weight = np.random.default_rng(0).standard_normal((96, 32)).astype(np.float32)
    inits = [
        numpy_helper.from_array(weight, "w"),
        numpy_helper.from_array(np.array([32, 64], np.int64), "sizes"),
        numpy_helper.from_array(np.array(0, np.int64), "i0"),
        numpy_helper.from_array(np.array(1, np.int64), "i1"),
    ]
    nodes = [
        helper.make_node("SplitToSequence", ["w", "sizes"], ["parts"], axis=0),
        helper.make_node("SequenceAt", ["parts", "i1"], ["kv"]),
        helper.make_node("MatMul", ["kv", "x"], ["y_kv"]),
        helper.make_node("SequenceAt", ["parts", "i0"], ["q"]),
        helper.make_node("MatMul", ["q", "x"], ["y_q"]),
    ]
    graph = helper.make_graph(
        nodes,
        "split_weight",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [32, "n"])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y_q", "y_kv")],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_sequence_elements_of_different_sizes_share_no_size_name() -> None:
    model = infer_shapes(split_weight_model(), strict=False)
    shapes = {
        v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in model.graph.value_info
    }
    assert shapes["q"][1:] == [32] and shapes["kv"][1:] == [32]
    assert not shapes["q"][0] and not shapes["kv"][0]  # unknown, not one name for 32 and 64
    q, kv = ort_run(ort_session(model), {"x": np.ones((32, 3), np.float32)})
    assert q.shape == (32, 3) and kv.shape == (64, 3)


def test_a_sequence_keeps_the_size_names_of_the_graphs_inputs() -> None:
    seq = helper.make_node("SplitToSequence", ["x"], ["parts"], axis=1, keepdims=0)
    at = helper.make_node("SequenceAt", ["parts", "i0"], ["first"])
    graph = helper.make_graph(
        [seq, at],
        "split_input",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor_value_info("first", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.array(0, np.int64), "i0")],
    )
    model = infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), strict=False)
    assert [d.dim_param for d in model.graph.output[0].type.tensor_type.shape.dim] == ["n"]
