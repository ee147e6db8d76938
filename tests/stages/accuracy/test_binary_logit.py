"""A binary classifier's one logit (``[N, 1]``, trained with ``binary_cross_entropy_with_logits`` on 0/1 labels):
the class-logit output where the data says the task has two classes (0/1 labels one per row, or ``num_classes``
2) or ``signature.logits_output`` names it. Its top-1 agreement is that of its decision (the logit above 0) and its
accuracy that decision against the 0/1 labels, gated by ``min_top1_agreement`` and ``max_accuracy_drop`` as any
class logits are, in validation and in the precision stage's check alike. A regression's ``[N, 1]`` is no such
logit."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from kiln.core.data import DatasetSplits, as_feed
from kiln.core.records import EngineValidation
from kiln.core.signature import Signature
from kiln.models.config import ModelConfig
from kiln.stages.accuracy.check import accuracy_failures, compare_on, gates_for, held_out, summarize
from kiln.stages.accuracy.config import CheckConfig

RNG = np.random.default_rng(0)
W = RNG.standard_normal((4, 1)).astype(np.float32)  # the click logit's weights
V = RNG.standard_normal((4, 1)).astype(np.float32)  # a value beside it
X = torch.from_numpy(RNG.standard_normal((160, 4)).astype(np.float32))
CLICK = (X.numpy() @ W + 0.5 * RNG.standard_normal((160, 1)) > 0).astype(np.float32)  # [N, 1], some mislabelled
TRAIN = 64


def _click(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"logits": feed["input"] @ W}


def _flipped(x: np.ndarray) -> np.ndarray:
    """The rows whose decision the engine below flips: a property of the row itself, whatever batch it comes in."""
    return x[:, 3] > 1.5


def _flipping(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """An engine that negates the logit of the rows :func:`_flipped` marks: their decision changes."""
    out = _click(feed)["logits"]
    return {"logits": np.where(_flipped(feed["input"])[:, None], -out, out)}


def _ctx(setting: str | None) -> Any:
    sig = Signature(logits_output=setting, batch_sizes=[1, 8])
    return SimpleNamespace(config=SimpleNamespace(signature=sig, validate=CheckConfig(), model=ModelConfig()))


def _reference(data: DatasetSplits, run: Any, names: list[str], setting: str | None = None) -> Any:
    """Validation's reference on ``data`` (the validate stage's own function, as a run calls it)."""
    from kiln.stages.validate.stage import reference

    feeds = held_out(data, lambda v: as_feed(v, ["input"]), {}, {}, None)
    return reference(_ctx(setting), data, CheckConfig(), run, feeds, names, {})


def _judged(ref: Any, engine: Any, precision: str = "fp32") -> tuple[EngineValidation, list[str]]:
    found = compare_on(ref, engine, [1, 8])
    entry = EngineValidation(name="e", backend="onnxruntime", precision=precision, device="cpu", status="validated")
    summarize(entry, found.stats, ref.logits)
    entry.accuracy = found.accuracy
    gates = gates_for(CheckConfig(), precision, ref.logits is None)
    return entry, accuracy_failures(entry, gates, ref.accuracy)


def _splits(y: torch.Tensor, num_classes: int) -> DatasetSplits:
    return DatasetSplits(X[:TRAIN], y[:TRAIN], X[TRAIN:], y[TRAIN:], num_classes=num_classes)


@pytest.mark.parametrize(
    ("labels", "num_classes"),
    [
        ("float [N, 1]", 2),  # the held-out user's: float clicks, num_classes 2
        ("float [N]", 2),
        ("integer [N]", 0),  # integer labels are classes
        ("integer [N]", 2),
    ],
)
def test_a_flipped_decision_of_a_one_logit_classifier_is_gated_by_top1_and_accuracy(
    labels: str, num_classes: int
) -> None:
    """The engine flips the click decision on a few held-out rows: top-1 agreement counts them and fails FP32's
    0.99, and accuracy compares the decisions with the labels, for the reference and the engine."""
    y = torch.from_numpy(CLICK)
    y = {"float [N, 1]": y, "float [N]": y[:, 0], "integer [N]": y[:, 0].long()}[labels]
    ref = _reference(_splits(y, num_classes), _click, ["logits"])
    entry, failures = _judged(ref, _flipping)
    val, truth = X[TRAIN:].numpy(), CLICK[TRAIN:, 0] > 0.5
    flipped = _flipped(val)
    assert 0 < flipped.sum() < 0.1 * len(val)
    assert ref.logits == "logits" and entry.top1_agreement == pytest.approx(1 - flipped.mean())
    decisions = (val @ W)[:, 0] > 0
    assert ref.accuracy == pytest.approx(np.mean(decisions == truth))
    assert entry.accuracy == pytest.approx(np.mean((decisions ^ flipped) == truth))
    assert any(f.startswith("top1_agreement") for f in failures), failures
    same, none = _judged(ref, _click)
    assert same.top1_agreement == 1.0 and same.accuracy == ref.accuracy and none == []


@pytest.mark.parametrize(
    "y",
    [
        torch.from_numpy(X.numpy() @ W * 3.0 + 1.0),  # values to predict
        torch.from_numpy((X.numpy() @ W > 0)[:, 0] * 2 + (X.numpy()[:, 0] > 0)).long(),  # 4 classes
        torch.from_numpy(CLICK),  # float 0/1 targets without num_classes: a least-squares rate's, no threshold
    ],
    ids=["regression", "four classes", "float 0/1 without num_classes"],
)
def test_a_one_value_output_of_no_binary_task_has_no_decision_to_agree_on(y: torch.Tensor) -> None:
    """A regression's [N, 1] (float targets, 0/1 ones too unless num_classes is 2) or a one-value head beside labels
    of 4 classes: no top-1 agreement and
    no accuracy, whatever the signs of its values do; its error is gated instead."""
    ref = _reference(_splits(y, 0), _click, ["logits"])
    entry, failures = _judged(ref, _flipping)
    assert ref.logits is None and entry.top1_agreement is None and entry.accuracy is None
    assert not any(f.startswith("top1_agreement") for f in failures) and failures  # its error is


def _two_heads(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"click": feed["input"] @ W, "value": feed["input"] @ V}


def _two_heads_flipping(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = _two_heads(feed)
    return {**out, "click": _flipping(feed)["logits"]}


def test_a_named_click_logit_beside_a_value_is_held_to_its_decision_and_its_note_says_why_no_accuracy() -> None:
    """Two heads, targets packed in one [N, 2] tensor (click, value) and num_classes 2: ``signature.logits_output:
    click`` holds the click logit to top-1 agreement; its labels are no 0/1 column, so no accuracy, and the note
    says so rather than pointing to a metric no one set."""
    from kiln.stages.validate.stage import accuracy_absent

    y = torch.from_numpy(np.concatenate([CLICK, X.numpy() @ V], 1))
    data = _splits(y, 2)
    ref = _reference(data, _two_heads, ["click", "value"], "click")
    entry, failures = _judged(ref, _two_heads_flipping)
    assert entry.outputs["click"]["top1_agreement"] == pytest.approx(1 - _flipped(X[TRAIN:].numpy()).mean())
    assert entry.outputs["value"]["top1_agreement"] is None and any(f.startswith("top1") for f in failures)
    assert ref.accuracy is None
    note = accuracy_absent(ref, data)
    assert note.startswith("the labels float32[96, 2] are no 0/1 label per row for 'click'") and "metric" not in note
    unnamed = _reference(data, _two_heads, ["click", "value"])  # two outputs, none named 'logits'
    assert unnamed.logits is None


def test_the_precision_stage_holds_a_one_logit_classifier_to_its_decision(tmp_path: Path) -> None:
    """The precision stage accepts a variant by validation's check: on float 0/1 labels the stage finds no class
    logits by their name (float targets), and the check still holds the one logit to top-1 agreement."""
    from kiln.core.onnx_io import io_specs
    from kiln.stages.precision.stage import held_out_check

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["input", "w"], ["logits"])],
        "click",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 1])],
        [numpy_helper.from_array(W, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    src = SimpleNamespace(model=model, logits=None)  # class_logits: float targets name no class logits
    check = held_out_check(_ctx(None), _splits(torch.from_numpy(CLICK), 2), src, io_specs(model)[0])
    verdict = check(model, "fp32")
    assert check.ref.logits == "logits" and verdict.metrics["top1_agreement"] == 1.0
    assert check.ref.accuracy is not None
    onnx.checker.check_model(model)


def test_float_clicks_without_num_classes_are_warned_of_as_judged_a_regression(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The usual way to train a one-logit classifier (BCE-with-logits takes float targets) without num_classes:
    judged as a rate, which a warning says, with the setting that holds the decision."""
    import logging

    with caplog.at_level(logging.WARNING, logger="kiln"):
        ref = _reference(_splits(torch.from_numpy(CLICK), 0), _click, ["logits"])
    assert ref.logits is None
    said = [r.getMessage() for r in caplog.records if "float 0/1 targets" in r.getMessage()]
    assert len(said) == 1 and "num_classes=2" in said[0]


def _score(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A two-tower model's click score: one value per row, no class axis (``(u * v).sum(-1)``)."""
    return {"logits": (feed["input"] @ W)[:, 0]}


def _score_flipping(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = _score(feed)["logits"]
    return {"logits": np.where(_flipped(feed["input"]), -out, out)}


@pytest.mark.parametrize(
    ("labels", "num_classes"), [("float [N]", 2), ("float [N, 1]", 2), ("integer [N]", 0), ("integer [N]", 2)]
)
def test_a_click_score_of_one_value_per_row_is_gated_by_its_decision_as_a_column_is(
    labels: str, num_classes: int
) -> None:
    """A score ``[N]`` in a binary task is the one logit ``[N, 1]`` is: the flipped decisions fail top-1 agreement
    and move the accuracy, which the reference and the engine both have."""
    y = torch.from_numpy(CLICK)
    y = {"float [N, 1]": y, "float [N]": y[:, 0], "integer [N]": y[:, 0].long()}[labels]
    ref = _reference(_splits(y, num_classes), _score, ["logits"])
    entry, failures = _judged(ref, _score_flipping)
    val, truth = X[TRAIN:].numpy(), CLICK[TRAIN:, 0] > 0.5
    flipped, decisions = _flipped(val), (val @ W)[:, 0] > 0
    assert ref.logits == "logits" and ref.binary_at == 0.0
    assert entry.top1_agreement == pytest.approx(1 - flipped.mean())
    assert ref.accuracy == pytest.approx(np.mean(decisions == truth))
    assert entry.accuracy == pytest.approx(np.mean((decisions ^ flipped) == truth))
    assert any(f.startswith("top1_agreement") for f in failures), failures
    same, none = _judged(ref, _score)
    assert same.top1_agreement == 1.0 and same.accuracy == ref.accuracy and none == []


def _dict_score(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"score": _score(feed)["logits"], "user_vec": feed["input"] @ V}


def _dict_score_flipping(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {**_dict_score(feed), "score": _score_flipping(feed)["logits"]}


def test_a_named_click_score_of_one_value_per_row_is_held_to_its_decision() -> None:
    """``signature.logits_output: score`` on a dict of a score ``[N]`` and a user vector, float clicks and
    num_classes 2: the score is held to its decision's agreement and scored for accuracy."""
    ref = _reference(_splits(torch.from_numpy(CLICK[:, 0]), 2), _dict_score, ["score", "user_vec"], "score")
    entry, failures = _judged(ref, _dict_score_flipping)
    assert ref.logits == "score" and ref.accuracy is not None and entry.accuracy is not None
    assert entry.outputs["score"]["top1_agreement"] == pytest.approx(1 - _flipped(X[TRAIN:].numpy()).mean())
    assert entry.outputs["user_vec"]["top1_agreement"] is None and any(f.startswith("top1") for f in failures)


@pytest.mark.parametrize(
    "y",
    [torch.from_numpy(X.numpy() @ W * 3.0 + 1.0)[:, 0], torch.from_numpy(CLICK[:, 0])],
    ids=["regression", "float 0/1 without num_classes"],
)
def test_a_value_per_row_of_no_binary_task_stays_a_regressions(y: torch.Tensor) -> None:
    """A prediction ``[N]`` of float targets (0/1 ones too, without num_classes 2) has no decision to agree on."""
    ref = _reference(_splits(y, 0), _score, ["logits"])
    entry, failures = _judged(ref, _score_flipping)
    assert ref.logits is None and entry.top1_agreement is None and entry.accuracy is None
    assert not any(f.startswith("top1_agreement") for f in failures) and failures


def _score_graph() -> onnx.ModelProto:
    """The click score as a graph: ``input [batch, 4] @ w [4]`` gives ``logits [batch]``."""
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["input", "w"], ["logits"])],
        "score",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch"])],
        [numpy_helper.from_array(W[:, 0], "w")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_the_precision_stage_holds_a_click_score_to_its_decision() -> None:
    """The precision stage's check on a score ``[batch]`` beside float clicks and num_classes 2, and the direct
    command's on a score the user names (no data to say otherwise): both hold it to its decision's agreement."""
    from kiln.core.onnx_io import io_specs
    from kiln.stages.precision.gate import GateCheck
    from kiln.stages.precision.stage import held_out_check

    model = _score_graph()
    src = SimpleNamespace(model=model, logits=None)
    check = held_out_check(_ctx(None), _splits(torch.from_numpy(CLICK[:, 0]), 2), src, io_specs(model)[0])
    verdict = check(model, "fp32")
    assert check.ref.logits == "logits" and verdict.metrics["top1_agreement"] == 1.0
    assert check.ref.accuracy is not None
    named = GateCheck.on_samples(model, X.numpy()[:32], 0)
    assert named.ref.binary_at == 0.0 and named(model, "fp32").metrics["top1_agreement"] == 1.0
