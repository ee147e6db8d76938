"""A multi-label head: logits ``[N, K]`` beside float 0/1 targets shaped like them (binary cross-entropy on the
logits, ``validate.metric: multilabel_f1``). Each label is a decision of its own, the logit above 0: where the
logits are class logits (named in ``signature.logits_output``, or ``num_classes`` K in the data) they are held
to decision agreement, the share of (sample, label) pairs whose decision is the reference's, gated by
``min_top1_agreement``, in place of the agreement of their argmax, which a multi-label head does not answer by."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from kiln.core.data import DatasetSplits, as_feed
from kiln.core.signature import Signature
from kiln.models.config import ModelConfig
from kiln.stages.accuracy.check import held_out
from kiln.stages.accuracy.config import CheckConfig
from tests.stages.accuracy.judging import judged

RNG = np.random.default_rng(0)
W = RNG.standard_normal((6, 5)).astype(np.float32)  # five labels
X = RNG.standard_normal((160, 6)).astype(np.float32)
TAGS = (X @ W > 0).astype(np.float32)  # multi-hot: each row has several labels on
NEAR = 0.3  # the engine below flips the labels whose logit lies within this of 0


def _run(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"logits": feed["input"] @ W}


def _flipped(z: np.ndarray) -> np.ndarray:
    """The logits the engine below negates: those within ``NEAR`` of 0, in rows whose largest logit lies beyond it."""
    return (np.abs(z) < NEAR) & (z.max(1, keepdims=True) > NEAR)


def _near_zero_flipping(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """An engine that negates the logits near the threshold (:func:`_flipped`): those labels' decisions flip, while
    each row's largest logit stays the largest (the argmax agrees)."""
    out = _run(feed)["logits"]
    return {"logits": np.where(_flipped(out), -out, out)}


def _reference(num_classes: int, setting: str | None) -> Any:
    from kiln.stages.validate.stage import reference

    y = torch.from_numpy(TAGS)
    data = DatasetSplits(torch.from_numpy(X[:64]), y[:64], torch.from_numpy(X[64:]), y[64:], num_classes=num_classes)
    sig = Signature(logits_output=setting, batch_sizes=[1, 8])
    ctx = SimpleNamespace(config=SimpleNamespace(signature=sig, validate=CheckConfig(), model=ModelConfig()))
    feeds = held_out(data, lambda v: as_feed(v, ["input"]), {}, {}, None)
    return reference(ctx, data, CheckConfig(metric="multilabel_f1"), _run, feeds, ["logits"], {})


@pytest.mark.parametrize(("num_classes", "setting"), [(5, None), (5, "logits"), (0, "logits")])
def test_labels_flipped_near_the_threshold_fail_decision_agreement(num_classes: int, setting: str | None) -> None:
    """A few percent of the (sample, label) decisions flip, no row's argmax: decision agreement counts the flips and
    fails INT8's 0.97, where argmax agreement was 1.0 and passed the engine."""
    ref = _reference(num_classes, setting)
    entry, failures = judged(ref, _near_zero_flipping, [1, 8], "int8")
    z = X[64:] @ W
    flipped = _flipped(z)
    assert (_near_zero_flipping({"input": X[64:]})["logits"].argmax(1) == z.argmax(1)).all()
    assert 0.03 < flipped.mean() < 0.2
    assert ref.logits == "logits" and entry.top1_agreement == pytest.approx(1 - flipped.mean())
    assert any(f.startswith("top1_agreement") for f in failures), failures
    same, none = judged(ref, _run, [1, 8], "int8")
    assert same.top1_agreement == 1.0 and none == []


def test_decision_agreement_is_said_where_the_reference_is_made(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import logging

    monkeypatch.setattr(logging.getLogger("kiln"), "propagate", True)  # the CLI tests turn it off
    with caplog.at_level(logging.INFO, logger="kiln"):
        _reference(5, None)
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "decision agreement" in said and "(sample, label)" in said, said
