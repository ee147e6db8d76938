"""A regression that no metric scores passes on agreement alone: the validate stage warns why, with the fix."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kiln.core.data import DatasetSplits, as_feed
from kiln.core.signature import Signature
from kiln.models.config import ModelConfig
from kiln.stages.accuracy.check import held_out
from kiln.stages.accuracy.config import CheckConfig
from kiln.stages.validate.stage import reference, unscored

X = torch.randn(16, 3, generator=torch.Generator().manual_seed(0))
Y = X[:, :1] * 2.0  # float targets: one value per row


def _gaussian(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A {mean, log_var} head: two outputs, each as large as the targets."""
    x = feed["input"]
    return {"mean": x[:, :1] * 2.0, "log_var": x[:, 1:2]}


def _linear(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"logits": feed["input"][:, :1] * 2.0}


def _unscored(data: DatasetSplits, run, names: list[str], setting: str | None = None) -> str | None:
    """What the stage warns of for ``run`` on ``data`` (None: something scores it), from its own reference."""
    sig = Signature(logits_output=setting, batch_sizes=[1, 8])
    ctx = SimpleNamespace(config=SimpleNamespace(signature=sig, model=ModelConfig()))
    feeds = held_out(data, lambda v: as_feed(v, ["input"]), {}, {}, None)
    ref = reference(ctx, data, CheckConfig(), run, feeds, names, {})
    return unscored(ref, data, setting)


@pytest.mark.parametrize(
    ("run", "names", "num_classes", "why"),
    [
        (_gaussian, ["mean", "log_var"], 0, "outputs mean, log_var each have as many values as the targets"),
        (_linear, ["logits"], 1, "num_classes 1 is declared beside them"),
    ],
    ids=["two-heads", "num-classes"],
)
def test_float_targets_no_metric_scores_are_warned_of_with_the_setting_that_scores_them(
    run, names: list[str], num_classes: int, why: str
) -> None:
    """A {mean, log_var} head without signature.logits_output, and float targets beside num_classes, passed with no
    word on stderr: only report.md said no metric scores them."""
    said = _unscored(DatasetSplits(X, Y, X, Y, num_classes), run, names)
    assert said is not None and said.startswith("no task metric scores the float targets float32[16, 1]"), said
    assert why in said and "validate.metric (mse for values to predict" in said, said
    if len(names) > 1:
        assert "signature.logits_output to the output that is the prediction (mean or log_var)" in said, said


def test_float_targets_a_metric_scores_are_no_warning() -> None:
    assert _unscored(DatasetSplits(X, Y, X, Y), _linear, ["logits"]) is None  # the default mse scores them
    assert _unscored(DatasetSplits(X, Y, X, Y), _gaussian, ["mean", "log_var"], "mean") is None  # named: mse


def _click(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A binary classifier's one logit beside its sigmoid."""
    logit = feed["input"][:, :1] * 2.0
    return {"logit": logit, "proba": 1.0 / (1.0 + np.exp(-logit))}


@pytest.mark.parametrize("per_row", [True, False], ids=["N-1", "N"])
def test_0_1_targets_beside_one_logit_without_num_classes_are_told_num_classes_2(per_row: bool) -> None:
    """Float 0/1 targets one per row beside a one-logit head, with no num_classes: the fix is num_classes=2, which
    scores the logit's decision, not only a multi-label metric or mse."""
    clicks = (X[:, :1] > 0).float()
    y = clicks if per_row else clicks[:, 0]
    said = _unscored(DatasetSplits(X, y, X, y), _click, ["logit", "proba"], "logit")
    assert said is not None and "0/1 targets" in said, said
    assert "set num_classes=2 in DatasetSplits" in said, said
    assert "num_classes=2" not in (_unscored(DatasetSplits(X, Y, X, Y), _gaussian, ["mean", "log_var"]) or "")
