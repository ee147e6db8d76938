"""The precision stage's FP32 nodes after ORT's fusion (``keep_list_after_fusion``): nodes absorbed by a fused op
that computes in FP32 lose nothing and are not said; the rest are said naming the engine, as a warning only where
the device computes FP16."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.stages.engines.onnxruntime.build import keep_list_after_fusion


def _graph(nodes: list[onnx.NodeProto]) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])],
        [numpy_helper.from_array(np.ones(8, np.float32), "w")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _rms_norm() -> onnx.ModelProto:
    """T5's RMSNorm as exported: Pow -> ReduceMean -> Add -> Sqrt -> Div -> Mul(weight)."""
    c = [helper.make_node("Constant", [], [n], name=n, value_float=v) for n, v in (("two", 2.0), ("eps", 1e-6))]
    return _graph(
        c
        + [
            helper.make_node("Pow", ["x", "two"], ["p"], name="ln/Pow"),
            helper.make_node("ReduceMean", ["p"], ["m"], name="ln/ReduceMean", axes=[-1]),
            helper.make_node("Add", ["m", "eps"], ["a"], name="ln/Add"),
            helper.make_node("Sqrt", ["a"], ["s"], name="ln/Sqrt"),
            helper.make_node("Div", ["x", "s"], ["d"], name="ln/Div"),
            helper.make_node("Mul", ["w", "d"], ["y"], name="ln/Mul"),
        ]
    )


def _fused(op: str) -> onnx.ModelProto:
    return _graph([helper.make_node(op, ["x", "w"], ["y"], name=f"{op}_0", domain="com.microsoft")])


def test_nodes_fused_into_an_fp32_normalization_are_not_said(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kiln"):
        kept, record = keep_list_after_fusion(
            _rms_norm(), _fused("SimplifiedLayerNormalization"), ["ln/Pow", "ln/Sqrt"], "ort-cuda-fp16", "cuda"
        )
    assert kept == [] and record["lost"] == [] and record["in_fp32_kernels"] == 2, record
    assert "fused away" not in caplog.text


@pytest.mark.parametrize("device, level", [("cuda", logging.WARNING), ("cpu", logging.INFO)])
def test_nodes_fused_into_another_op_are_said_naming_the_engine(
    caplog: pytest.LogCaptureFixture, device: str, level: int
) -> None:
    with caplog.at_level(logging.INFO, logger="kiln"):
        _, record = keep_list_after_fusion(_rms_norm(), _fused("FastGelu"), ["ln/Pow"], "eng-fp16", device)
    assert record["lost"] == ["ln/Pow"], record
    said = [r for r in caplog.records if "fused away" in r.getMessage()]
    assert [r.levelno for r in said] == [level] and said[0].getMessage().startswith("eng-fp16: 1 nodes"), said
