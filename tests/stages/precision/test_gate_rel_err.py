"""The precision stage's check of a variant records the relative error its gates judge, beside the cosines: on a
model with no class logits (a regression, a diffusion model's noise) it is the figure the gate holds."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.stages.precision.gate import GateCheck


def scaled(factor: float) -> onnx.ModelProto:
    """x [batch, 8] -> x * factor."""
    k = numpy_helper.from_array(np.array(factor, np.float32), "k")
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "k"], ["y"])],
        "scaled",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])],
        [k],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def test_a_variant_records_the_relative_error_its_gates_judge() -> None:
    x = np.random.default_rng(0).standard_normal((32, 8)).astype(np.float32)
    check = GateCheck.on_samples(scaled(1.0), x, logits=None)
    verdict = check(scaled(1.01), "fp16")
    assert verdict.metrics["top1_agreement"] is None
    assert verdict.metrics["rel_err"] == pytest.approx(0.01, rel=0.05)
    assert verdict.metrics["cosine"] == pytest.approx(1.0, abs=1e-6)
