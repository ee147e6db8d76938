"""The precision stage's check of a variant reads its headline figures over the outputs ``validate.gates.
gated_outputs`` lists, as validation does: the fallback's own targets (``precision.fallback.min_cosine``) and its
ranking of rounds (the verdict's metrics) follow the gated class logits, not an ungated hidden state beside them;
a multi-label head's agreement is named decision agreement in its failures."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from kiln.core.data import DatasetSplits
from kiln.stages.accuracy.check import Reference
from kiln.stages.accuracy.config import GatesConfig
from kiln.stages.precision.config import FallbackConfig
from kiln.stages.precision.gate import GateCheck, session_runner

RNG = np.random.default_rng(0)
W = RNG.standard_normal((6, 5)).astype(np.float32)  # the class logits' weights
V = RNG.standard_normal((6, 8)).astype(np.float32)  # a hidden state's
X = RNG.standard_normal((64, 6)).astype(np.float32)
STRICT = FallbackConfig(min_cosine=0.999)


def _graph(w: np.ndarray, v: np.ndarray | None = None) -> onnx.ModelProto:
    """input [batch, 6] -> logits [batch, 5] = input @ w, and hidden [batch, 8] = input @ v where ``v`` is given."""
    nodes = [helper.make_node("MatMul", ["input", "w"], ["logits"])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 5])]
    inits = [numpy_helper.from_array(w, "w")]
    if v is not None:
        nodes.append(helper.make_node("MatMul", ["input", "v"], ["hidden"]))
        outputs.append(helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["batch", 8]))
        inits.append(numpy_helper.from_array(v, "v"))
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 6])], outputs, inits
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_an_ungated_output_fails_no_fallback_target_and_ranks_no_round() -> None:
    """The hidden state of the variant is off (cosine about 0.9), its logits exact: with only the logits gated, the
    fallback's ``min_cosine`` target passes and the verdict's cosines are the logits'; with every output gated, the
    hidden state misses that target."""
    off = V + 0.5 * RNG.standard_normal(V.shape).astype(np.float32)
    fp32, variant = _graph(W, V), _graph(W, off)
    only_logits = GateCheck.on_samples(fp32, X, 0, GatesConfig(gated_outputs=["logits"]))
    verdict = only_logits(variant, "fp16", STRICT)
    assert verdict.failures == []
    assert verdict.metrics["cosine"] > 0.9999 and verdict.metrics["sample_cosine"] > 0.9999, verdict.metrics
    every = GateCheck.on_samples(fp32, X, 0)(variant, "fp16", STRICT)
    assert any(f.startswith("cosine ") and "< fallback target 0.999" in f for f in every.failures), every.failures
    assert every.metrics["cosine"] < 0.999


def _flipped(z: np.ndarray) -> np.ndarray:
    """The logits near the threshold (within 0.3 of 0) in rows whose largest logit lies beyond it."""
    return (np.abs(z) < 0.3) & (z.max(1, keepdims=True) > 0.3)


def test_a_multi_label_heads_fallback_target_is_named_decision_agreement() -> None:
    """Multi-hot targets with ``num_classes`` 5: a variant that flips the labels near the threshold misses the
    fallback's ``min_top1_agreement`` by its decision agreement, and the failure says so."""
    fp32 = _graph(W)
    z = X @ W
    variant = _graph(W)  # the same logits, negated where _flipped: a Where on a constant mask of the held-out rows
    mask = numpy_helper.from_array(_flipped(z), "flip")
    variant.graph.initializer.append(mask)
    variant.graph.node[0].output[0] = "raw"
    variant.graph.node.extend(
        [helper.make_node("Neg", ["raw"], ["neg"]), helper.make_node("Where", ["flip", "neg", "raw"], ["logits"])]
    )
    tags = torch.from_numpy((z > 0).astype(np.float32))
    data = DatasetSplits(torch.from_numpy(X), tags, torch.from_numpy(X), tags, num_classes=5)
    ref = Reference(session_runner(fp32), [({}, {"input": X})], [None], "logits", 64, targets=tags.numpy(), data=data)
    verdict = GateCheck(fp32, ref, GatesConfig(), [64])(variant, "int8", FallbackConfig(min_top1_agreement=0.999))
    said = [f for f in verdict.failures if "fallback target" in f]
    assert said and said[0].startswith("decision agreement (per label"), verdict.failures
    assert verdict.metrics["top1_agreement"] == pytest.approx(1 - _flipped(z).mean())
