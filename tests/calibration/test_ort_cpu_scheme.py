"""``calibration.ort_cpu_scheme: auto``: dynamic where a graph's FLOPs are in MatMul/Gemm layers, static where they
are in convolutions, whatever other ops the graph has."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kiln.calibration.config import CalibrationConfig
from kiln.calibration.quantize import ort_cpu_scheme
from kiln.stages.precision.audit import flops_by_op

RNG = np.random.default_rng(0)


def _weight(name: str, *shape: int) -> onnx.TensorProto:
    return numpy_helper.from_array((RNG.standard_normal(shape) * 0.1).astype(np.float32), name)


def _model(nodes: list[onnx.NodeProto], inits: list[onnx.TensorProto], shape: list[int | str]) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("pixel_values", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def vit_like(shape: list[int | str] | None = None) -> onnx.ModelProto:
    """A ViT in miniature: a patchify Conv (8x8 patches of 32x32: 16 tokens of width 64), two large MatMuls per
    token, a mean over the tokens and a small Gemm head. Most FLOPs are in the MatMuls."""
    nodes = [
        helper.make_node("Conv", ["pixel_values", "patch_w"], ["patches"], name="patch_embed", strides=[8, 8]),
        helper.make_node("Reshape", ["patches", "tokens_shape"], ["flat"], name="flatten"),
        helper.make_node("Transpose", ["flat"], ["tokens"], name="to_tokens", perm=[0, 2, 1]),
        helper.make_node("MatMul", ["tokens", "fc1_w"], ["h"], name="fc1"),
        helper.make_node("Relu", ["h"], ["a"], name="act"),
        helper.make_node("MatMul", ["a", "fc2_w"], ["o"], name="fc2"),
        helper.make_node("ReduceMean", ["o"], ["pooled"], name="pool", axes=[1], keepdims=0),
        helper.make_node("Gemm", ["pooled", "head_w", "head_b"], ["logits"], name="head", transB=1),
    ]
    inits = [
        _weight("patch_w", 64, 3, 8, 8),
        numpy_helper.from_array(np.array([0, 64, -1], np.int64), "tokens_shape"),
        _weight("fc1_w", 64, 256),
        _weight("fc2_w", 256, 64),
        _weight("head_w", 10, 64),
        _weight("head_b", 10),
    ]
    return _model(nodes, inits, shape or ["batch", 3, 32, 32])


def cnn() -> onnx.ModelProto:
    """A conv stack at 16x16 and a small Gemm head: most FLOPs are in the convolutions."""
    nodes = [
        helper.make_node("Conv", ["pixel_values", "c1_w"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "c2_w"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("GlobalAveragePool", ["r2"], ["p"], name="pool"),
        helper.make_node("Flatten", ["p"], ["f"], name="flat"),
        helper.make_node("Gemm", ["f", "head_w", "head_b"], ["logits"], name="head", transB=1),
    ]
    inits = [_weight("c1_w", 16, 3, 3, 3), _weight("c2_w", 16, 16, 3, 3), _weight("head_w", 10, 16)]
    return _model(nodes, [*inits, _weight("head_b", 10)], ["batch", 3, 16, 16])


def scheme(model: onnx.ModelProto, cfg: CalibrationConfig) -> str:
    """The scheme as the precision stage resolves it: with the graph's FLOPs by op type, which the audit counts."""
    return ort_cpu_scheme(model, cfg, flops_by_op(model))


def test_a_vit_with_a_patchify_conv_is_quantized_dynamically() -> None:
    assert scheme(vit_like(), CalibrationConfig()) == "dynamic"


def test_a_cnn_with_a_gemm_head_is_quantized_statically() -> None:
    assert scheme(cnn(), CalibrationConfig()) == "static"


def test_a_graph_whose_image_size_is_not_fixed_is_judged_by_its_ops() -> None:
    """Counted at 1 pixel, a convolution would weigh as little as its weights: with no size to count at, a graph
    with a convolution stays static, as before."""
    assert scheme(vit_like(["batch", 3, "height", "width"]), CalibrationConfig()) == "static"


def test_an_explicit_scheme_or_matmul_left_unquantized_decides_first() -> None:
    assert scheme(vit_like(), CalibrationConfig(ort_cpu_scheme="static")) == "static"
    assert scheme(cnn(), CalibrationConfig(ort_cpu_scheme="dynamic")) == "dynamic"
    assert scheme(vit_like(), CalibrationConfig(exclude_op_types=["MatMul"])) == "static"
