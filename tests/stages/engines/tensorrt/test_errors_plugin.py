"""An op TensorRT's parser imports through a plugin its build lacks (TensorRT-RTX's NonZero): the fix is the
model computed without the op, or another backend; no optimize pass or opset removes it."""

from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from kiln.core.errors import BuildError
from kiln.stages.engines.tensorrt.errors import parse_onnx, parser_hint


def nonzero(path: Path) -> Path:
    """x [batch, 4] -> NonZero: the indices a sparse mixture of experts routes tokens by."""
    node = helper.make_node("NonZero", ["x"], ["idx"], name="route")
    g = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("idx", TensorProto.INT64, [2, "n"])],
    )
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_a_missing_plugin_gets_a_fix_that_can_help() -> None:
    """onnx-tensorrt's own words for a plugin it cannot find, for an op it has no importer of."""
    hint = parser_hint("Route", 'creator && "Plugin not found, are the plugin name, version, and namespace correct?"')
    assert "Route as a plugin this TensorRT build lacks" in hint and "onnxruntime backend" in hint
    assert "opset" not in hint and "optimize" not in hint


@pytest.mark.tensorrt
def test_nonzero_without_its_plugin_is_told_to_compute_without_it(tmp_path: Path) -> None:
    trt = pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX (kiln[rtx]) is not installed")
    logger = trt.Logger(trt.Logger.INTERNAL_ERROR)
    network = trt.Builder(logger).create_network(0)
    try:
        parse_onnx(trt, network, logger, nonzero(tmp_path / "m.onnx"))
    except BuildError as err:
        hint = err.hint or ""
    else:
        pytest.skip(f"this {trt.__name__} {trt.__version__} imports NonZero")
    assert "NonZero as a plugin this TensorRT build lacks" in hint and "torch.nonzero" in hint
    assert "onnxruntime backend" in hint and "opset" not in hint


def test_a_zero_point_refusal_names_the_qat_qconfig_too() -> None:
    """A QAT model's asymmetric fake-quant exports non-zero zero points: the fix names the qconfig that avoids them,
    not only onnxruntime.quantization's options."""
    hint = parser_hint("QuantizeLinear", "Assertion failed: zero point must be 0")
    assert "qscheme=torch.per_tensor_symmetric" in hint and "ActivationSymmetric" in hint


def test_a_uint8_tensor_refused_by_an_op_is_told_to_cast_first() -> None:
    """Raw decoded frames (uint8) permuted before the model's own cast: no optimize pass or opset helps."""
    desc = "first input has type UInt8 but must have type Float, Half, BFloat16, Int32, Int64"
    hint = parser_hint("Transpose", desc)
    assert "x.float()" in hint and "onnxruntime backend" in hint
    assert "opset" not in hint and "optimize" not in hint
