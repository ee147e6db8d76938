"""Where the FP32 graph itself answers NaN/inf on held-out rows, the precision stage says so once and runs no
accuracy fallback: every candidate is measured against those outputs, which no node kept in float changes."""

from __future__ import annotations

import logging

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kiln.stages.precision.config import PrecisionConfig
from kiln.stages.precision.gate import GateCheck
from kiln.stages.precision.stage import without_futile_fallback

RNG = np.random.default_rng(0)
W = RNG.standard_normal((4, 3)).astype(np.float32)
X = np.abs(RNG.standard_normal((64, 4))).astype(np.float32)


def _sqrt_graph() -> onnx.ModelProto:
    """x [batch, 4] -> y [batch, 3] = sqrt(x) @ W: NaN on a row with a negative value."""
    graph = helper.make_graph(
        [helper.make_node("Sqrt", ["x"], ["r"]), helper.make_node("MatMul", ["r", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
        [numpy_helper.from_array(W, "w")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_nan_in_the_fp32_graph_turns_the_fallback_off(caplog) -> None:
    x = X.copy()
    x[[16, 40], 1] = -1.0
    cfg = PrecisionConfig()
    assert cfg.fallback.enabled
    with caplog.at_level(logging.WARNING):
        got = without_futile_fallback(cfg, GateCheck.on_samples(_sqrt_graph(), x, 0), logging.getLogger("t"))
    assert not got.fallback.enabled
    assert "answers NaN/inf in output 'y' at 2 of 64 held-out rows (first: 16)" in caplog.text, caplog.text


def test_a_finite_fp32_graph_keeps_the_fallback() -> None:
    cfg = PrecisionConfig()
    assert without_futile_fallback(cfg, GateCheck.on_samples(_sqrt_graph(), X, 0), logging.getLogger("t")) is cfg
