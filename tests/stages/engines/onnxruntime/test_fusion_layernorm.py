"""ORT's transformer fusion on a LayerNormalization without a bias (``nn.LayerNorm(elementwise_affine=False)``, a
DiT's adaLN blocks: two inputs in the dynamo exporter's graph): fused with a zero bias given, never a crash; and a
failure inside ORT's optimizer keeps the unfused graph, said in the log."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.core.onnx_io import ort_session
from kiln.stages.engines.onnxruntime import build
from kiln.stages.engines.onnxruntime.config import OnnxRuntimeConfig


def _skip_layernorm() -> onnx.ModelProto:
    """x + MatMul(x, w) -> LayerNormalization(scale only) -> y: ORT's SkipLayerNormalization pattern, no bias."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32), "w"),
        numpy_helper.from_array(np.ones(16, np.float32), "scale"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
        helper.make_node("Add", ["x", "h"], ["s"], name="add"),
        helper.make_node("LayerNormalization", ["s", "scale"], ["y"], name="ln", axis=-1, epsilon=1e-5),
    ]
    graph = helper.make_graph(
        nodes,
        "ln",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4, 16])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_a_layernorm_without_bias_is_fused_with_a_zero_one() -> None:
    model = _skip_layernorm()
    fused, info = build.maybe_fuse(model, "cpu", OnnxRuntimeConfig(transformer_fusion="on"))
    assert info["applied"] is True and "SkipLayerNormalization" in info["fused"], info
    x = np.random.default_rng(1).standard_normal((2, 4, 16)).astype(np.float32)
    want = ort_session(model).run(None, {"x": x})[0]
    np.testing.assert_allclose(ort_session(fused).run(None, {"x": x})[0], want, atol=1e-4)
    assert [len(n.input) for n in model.graph.node if n.op_type == "LayerNormalization"] == [2]  # caller's untouched


def test_a_failure_inside_the_optimizer_keeps_the_unfused_graph(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    import onnxruntime.transformers.optimizer as optimizer

    def broken(*args, **kwargs):
        raise IndexError("list index out of range")

    monkeypatch.setattr(optimizer, "optimize_model", broken)
    model = _skip_layernorm()
    with caplog.at_level(logging.WARNING, logger="kiln"):
        kept, info = build.maybe_fuse(model, "cpu", OnnxRuntimeConfig(transformer_fusion="on"))
    assert kept is model and info["applied"] is False and "IndexError" in info["why"], info
    assert "ORT transformer fusion not applied: IndexError" in caplog.text
