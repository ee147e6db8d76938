"""A contrib op (com.microsoft Gelu) leaves tensors shape inference cannot type: CPU INT8 still quantizes, and
where ORT's quantizer fails anyway, its error names the node to keep in float in whole sentences."""

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kiln.calibration.config import CalibrationConfig
from kiln.calibration.quantize import quantize_int8_dynamic, quantizer_failed, whole_sentences


def _contrib_mlp(path: Path) -> onnx.ModelProto:
    """MatMul -> Add -> com.microsoft Gelu -> MatMul -> Add: the second MatMul's output has no inferred type."""
    rng = np.random.default_rng(0)
    weights = {"w1": (16, 32), "b1": (32,), "w2": (32, 4), "b2": (4,)}
    inits = [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), n) for n, s in weights.items()]
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h0"], name="MatMul_0"),
        helper.make_node("Add", ["h0", "b1"], ["h1"], name="Add_1"),
        helper.make_node("Gelu", ["h1"], ["h2"], name="Gelu", domain="com.microsoft"),
        helper.make_node("MatMul", ["h2", "w2"], ["h3"], name="MatMul_2"),
        helper.make_node("Add", ["h3", "b2"], ["logits"], name="Add_3"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 4])],
        inits,
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    onnx.save(model, path)
    return model


def test_contrib_op_graph_quantizes_dynamically(tmp_path: Path) -> None:
    _contrib_mlp(tmp_path / "m.onnx")
    info = quantize_int8_dynamic(tmp_path / "m.onnx", tmp_path / "q.onnx", CalibrationConfig())
    assert info["integer_matmuls"] >= 1


def test_quantizer_error_names_the_node_writing_the_tensor(tmp_path: Path) -> None:
    model = _contrib_mlp(tmp_path / "m.onnx")
    exc = RuntimeError(
        "Unable to find data type for weight_name='h3'. shape_inference failed to return a type probably this node "
        "is from a different domain or using an input produced by such an operator. This may happen if you quantize "
        "a model already quantized. You may use extra_options `DefaultTensorType` to indicate the default weight "
        "type, usually `onnx.TensorProto.FLOAT`."
    )
    err = quantizer_failed("quantize_dynamic", exc, model, "int8")
    assert "calibration.exclude_nodes=[MatMul_2]" in err.hint and "writes tensor 'h3'" in err.hint
    assert err.message.endswith("already quantized.)") and "DefaultTensorType" not in err.message


def test_whole_sentences_end_on_no_half_word() -> None:
    assert whole_sentences("One. Two three four.", limit=10) == "One."
    assert whole_sentences("abcdef ghijkl", limit=10) == "abcdef ..."
