"""``validate.gates.gated_outputs``: the outputs the per-output gates hold. A seq2seq model's encoder state beside
its logits is compared and reported, and its misses fail neither an engine nor the precision stage's check
(the fallback's round) when only the logits are listed; a name the model has no output of is an error."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from kiln.core.data import DatasetSplits, as_feed
from kiln.core.errors import ConfigError
from kiln.core.onnx_io import io_specs
from kiln.core.signature import Signature
from kiln.models.config import ModelConfig
from kiln.stages.accuracy.check import accuracy_failures, gates_for, held_out
from kiln.stages.accuracy.config import CheckConfig
from tests.stages.accuracy.judging import judged

RNG = np.random.default_rng(0)
W = RNG.standard_normal((4, 3)).astype(np.float32)  # the class logits' weights
V = RNG.standard_normal((4, 8)).astype(np.float32)  # a hidden state's
X = RNG.standard_normal((96, 4)).astype(np.float32)
Y = torch.from_numpy((X @ W).argmax(1))  # three classes the logits get right
ONLY_LOGITS = {"gated_outputs": ["logits"]}


def _data() -> DatasetSplits:
    x = torch.from_numpy(X)
    return DatasetSplits(x[:32], Y[:32], x[32:], Y[32:], num_classes=3)


def _model(hidden_scale: float = 1.0) -> Any:
    """An ONNX graph of two outputs, ``logits`` and ``hidden``; ``hidden_scale`` scales the hidden state alone (a
    calibrated range that moved it: cosine 1, a relative error of ``hidden_scale - 1``)."""
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["input", "w"], ["logits"]),
            helper.make_node("MatMul", ["input", "v"], ["hidden"]),
        ],
        "two_outputs",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 4])],
        [
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 3]),
            helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["batch", 8]),
        ],
        [numpy_helper.from_array(W, "w"), numpy_helper.from_array(V * np.float32(hidden_scale), "v")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _ctx(gates: dict[str, Any] | None = None) -> Any:
    sig = Signature(batch_sizes=[1, 8])
    cfg = CheckConfig(gates=gates or {})
    return SimpleNamespace(config=SimpleNamespace(signature=sig, validate=cfg, model=ModelConfig()))


def _run(scale: float = 1.0) -> Any:
    def run(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"logits": feed["input"] @ W, "hidden": feed["input"] @ V * np.float32(scale)}

    return run


def _validation(gates: dict[str, Any] | None, scale: float) -> tuple[Any, list[str]]:
    """An INT8 engine whose hidden state is ``scale`` times the reference's, judged as validation judges it."""
    from kiln.stages.validate.stage import reference

    data, ctx = _data(), _ctx(gates)
    feeds = held_out(data, lambda v: as_feed(v, ["input"]), {}, {}, None)
    ref = reference(ctx, data, ctx.config.validate, _run(), feeds, ["logits", "hidden"], {})
    return judged(ref, _run(scale), [1, 8], "int8", ctx.config.validate)


def test_an_output_left_out_of_gated_outputs_is_compared_and_reported_but_fails_no_engine() -> None:
    """The hidden state 1.3 times the reference's misses INT8's relative error (0.14) and fails the engine while
    every output is gated; with ``gated_outputs: [logits]`` its figures are still in the entry and it fails nothing."""
    entry, failures = _validation(None, 1.3)
    assert any(f.startswith("output 'hidden' relative error") for f in failures), failures
    entry, failures = _validation(ONLY_LOGITS, 1.3)
    assert failures == [] and entry.outputs["hidden"]["rel_err"] > 0.2
    assert entry.top1_agreement == 1.0


def test_the_logits_left_out_are_not_held_to_top1_agreement_and_listed_ones_are() -> None:
    """Top-1 agreement belongs to the class-logit output: gated only where that output is listed."""
    entry, _ = _validation(None, 1.0)
    entry.top1_agreement = entry.outputs["logits"]["top1_agreement"] = 0.5  # an engine that flips half the rows
    gates = gates_for(CheckConfig(), "int8")
    assert accuracy_failures(entry, {**gates, "gated_outputs": ["logits"]}, None)[0].startswith("top1_agreement")
    assert accuracy_failures(entry, {**gates, "gated_outputs": ["hidden"]}, None) == []


def test_the_precision_stage_check_follows_gated_outputs() -> None:
    """The precision stage accepts a variant (a fallback round) by validation's check, which reads the gates of
    ``validate.gates``: the variant whose hidden state alone is off is refused by default and accepted with only the
    logits gated."""
    from kiln.stages.precision.stage import held_out_check

    fp32, variant = _model(), _model(1.3)
    src = SimpleNamespace(model=fp32, logits=0)
    every = held_out_check(_ctx(), _data(), src, io_specs(fp32)[0])(variant, "int8")
    assert any("output 'hidden' relative error" in f for f in every.failures), every.failures
    logits_only = held_out_check(_ctx(ONLY_LOGITS), _data(), src, io_specs(fp32)[0])(variant, "int8")
    assert logits_only.failures == []


def test_a_gated_output_the_model_does_not_have_is_an_error_naming_its_outputs() -> None:
    with pytest.raises(ConfigError) as err:
        _validation({"gated_outputs": ["logit"]}, 1.0)
    assert "'logit'" in err.value.message and "['logits', 'hidden']" in err.value.message
    assert "validate.gates.gated_outputs" in (err.value.hint or "")


@pytest.mark.parametrize(
    "gates, match",
    [
        ({"gated_outputs": []}, "at least 1 item"),
        ({"per_precision": {"int8": {"gated_outputs": ["logits"]}}}, "one list for every precision"),
    ],
)
def test_gated_outputs_is_a_list_of_names_for_every_precision(gates: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CheckConfig(gates=gates)


def test_a_nan_cosine_is_said_as_undefined_with_its_likely_causes() -> None:
    from kiln.stages.accuracy.check import _output_failures

    stats = {"cosine": float("nan"), "max_abs_err": 0.5, "rel_err": None}
    gates = {"min_cosine": 0.99, "max_abs_err": None, "min_top1_agreement": 0.97}
    (failure,) = _output_failures("output 'reg' ", stats, gates, None)
    assert failure == "output 'reg' cosine undefined (one side all zeros, or NaN/inf in it) < min_cosine 0.99"
