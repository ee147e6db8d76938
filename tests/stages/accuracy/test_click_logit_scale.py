"""A binary classifier's one logit (a click model's ``[N, 1]``) is the probability it answers: an 8-bit engine that
scales or shifts it keeps every decision and every ranking, and moves the click rate. Its relative error is held as
any value's, where a softmax's class logits are spared it in an 8-bit engine. The messages about such a logit speak
of its decision, not of an argmax over one column."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from kiln.core.errors import ModelError
from kiln.core.records import EngineValidation
from kiln.stages.accuracy.check import (
    CheckConfig,
    Reference,
    accuracy_failures,
    compare_all,
    gates_for,
    merge_worst,
    summarize,
)
from kiln.stages.accuracy.metrics import resolve_metric

RNG = np.random.default_rng(0)
X = RNG.standard_normal((64, 4)).astype(np.float32)


def _judged(ref: np.ndarray, got: np.ndarray, precision: str) -> tuple[EngineValidation, list[str]]:
    """The entry and failures of an engine of ``precision`` answering ``got`` where the reference answers ``ref``."""
    stats = compare_all({"logits": ref}, {"logits": got}, "logits")
    entry = EngineValidation(name="e", backend="onnxruntime", precision=precision, device="cpu", status="validated")
    entry.gates = gates_for(CheckConfig(), precision)
    summarize(entry, stats, "logits")
    return entry, accuracy_failures(entry, entry.gates, None)


def test_an_int8_click_logit_scaled_by_1_6_fails_its_relative_error() -> None:
    """Every decision (the logit above 0) and the ranking are kept, so only the relative error sees the scale."""
    logit = X @ RNG.standard_normal((4, 1)).astype(np.float32)
    entry, failures = _judged(logit, 1.6 * logit, "int8")
    assert entry.top1_agreement == 1.0 and entry.cosine == pytest.approx(1.0)
    assert entry.gates["rel_err_outputs"] == ["logits"] and entry.outputs["logits"]["decision_at"] == 0.0
    assert len(failures) == 1 and failures[0].startswith("relative error 0.6"), failures


def test_an_int8_softmax_head_keeps_its_class_logits_spared() -> None:
    """Three class logits scaled alike keep their argmax: an 8-bit engine's calibrated range, spared as before."""
    logits = X @ RNG.standard_normal((4, 3)).astype(np.float32)
    entry, failures = _judged(logits, 1.6 * logits, "int8")
    assert not failures and entry.gates["rel_err_outputs"] == []
    assert "decision_at" not in entry.outputs["logits"]


def test_merged_shapes_keep_the_click_logits_note() -> None:
    """The worst over shapes (merge_worst) keeps the note that the logit is a binary classifier's."""
    logit = X @ RNG.standard_normal((4, 1)).astype(np.float32)
    a = compare_all({"logits": logit}, {"logits": logit}, "logits")
    b = compare_all({"logits": logit[:8]}, {"logits": 1.6 * logit[:8]}, "logits")
    merged = merge_worst(a, b)["logits"]
    assert getattr(merged, "decision_at", None) == 0.0


def _one_side_warnings(caplog: pytest.LogCaptureFixture, metric: str | None) -> list[str]:
    """The one-side warnings of a reference whose one logit is negative at every row, with ``metric`` set or not."""
    rows = 32
    logit = -np.abs(RNG.standard_normal((rows, 1))).astype(np.float32) - 0.1
    labels = (RNG.random(rows) < 0.2).astype(np.int64)
    x = np.arange(rows, dtype=np.float32)[:, None]
    caplog.clear()
    chosen = None if metric is None else resolve_metric(metric, "logit")
    Reference(
        lambda feed: {"logit": logit[feed["x"][:, 0].astype(int)]},
        [({}, {"x": x})],
        [labels],
        "logit",
        4,
        metric=chosen,
    )
    return [r.getMessage() for r in caplog.records if "the reference decides" in r.getMessage()]


def test_the_one_side_warning_names_the_metric_set_in_place_of_suggesting_one(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(logging.getLogger("kiln"), "propagate", True)  # the CLI tests turn it off
    caplog.set_level(logging.WARNING, logger="kiln")
    (said,) = _one_side_warnings(caplog, "multilabel_f1")
    assert "validate.metric (multilabel_f1)" in said and "ROC AUC" not in said and "module:function" not in said
    (said,) = _one_side_warnings(caplog, None)
    assert "ROC AUC" in said


def test_an_unnamed_one_column_output_is_said_to_be_held_to_its_decision(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inputs without labels (the direct commands): the one column's warning speaks of decision agreement."""
    monkeypatch.setattr(logging.getLogger("kiln"), "propagate", True)
    caplog.set_level(logging.INFO, logger="kiln")
    Reference(
        lambda feed: {"logits": feed["x"] @ np.ones((4, 1), np.float32)},
        [({}, {"x": X})],
        [None],
        "logits",
        8,
        named=False,
    )
    said = [r.getMessage() for r in caplog.records if "signature.logits_output=logits" in r.getMessage()]
    assert len(said) == 1 and "argmax" not in said[0], said
    assert "holds its decision (the logit above 0) to decision agreement" in said[0]


def test_detection_recall_on_labels_without_a_class_column_says_how_to_shape_them() -> None:
    """Labels [N, M, 4] (boxes only): the labels are what is wrong, and the fix says their shape."""
    outputs = {"boxes": RNG.random((2, 3, 4)).astype(np.float32), "scores": RNG.random((2, 3, 2)).astype(np.float32)}
    with pytest.raises(ModelError) as raised:
        resolve_metric("detection_recall", "scores")(outputs, RNG.random((2, 3, 4)).astype(np.float32))
    hint = raised.value.hint or ""
    assert "[N, M, 5] rows of (class, x1, y1, x2, y2)" in hint and "(-1) on padding rows" in hint, hint
    assert "pick another built-in" not in hint


def test_detection_recall_on_outputs_without_boxes_blames_the_outputs_not_the_labels() -> None:
    """Good labels [N, M, 5] beside outputs with no [N, K, 4] boxes: the outputs are what the metric lacks."""
    outputs = {"scores": RNG.random((2, 3, 2)).astype(np.float32)}
    with pytest.raises(ModelError) as raised:
        resolve_metric("detection_recall", None)(outputs, RNG.random((2, 3, 5)).astype(np.float32))
    assert "boxes [N, K, 4]" in raised.value.message and "rows of (class" not in (raised.value.hint or "")
