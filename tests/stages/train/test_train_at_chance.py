"""A trained classifier that answers at chance level (held-out accuracy about 1/num_classes) is warned of once:
engines that agree with it prove little. Regression and a loss of the user's, whose chance level is unknown, stay
quiet."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from kiln.core.data import DatasetSplits
from kiln.stages.train.loop import train
from kiln.stages.train.metrics import EpochMetrics, TrainResult
from kiln.stages.train.stage import warn_at_chance
from tests.stages.train.train_helpers import tiny_data, tiny_net, train_cfg


def _random_labels(classes: int = 4, size: int = 160) -> DatasetSplits:
    """Noise with labels drawn apart from it: nothing to learn, so held-out accuracy stays near 1/classes."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn((size, 1, 8, 8), generator=g)
    y = torch.randint(0, classes, (size,), generator=g)
    cut = size * 3 // 4
    return DatasetSplits(x[:cut], y[:cut], x[cut:], y[cut:], num_classes=classes, name="random_labels")


def _warned(result: TrainResult, classes: int, chance: float | None, caplog: pytest.LogCaptureFixture) -> str:
    with caplog.at_level(logging.WARNING, logger="kiln.train"):
        warn_at_chance(result, classes, chance)
    return " ".join(caplog.messages)


def test_a_model_trained_on_random_labels_is_said_to_predict_at_chance(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 4))
    result = train(model, _random_labels(), train_cfg(epochs=2, lr=0.01))
    said = _warned(result, 4, math.log(4), caplog)
    assert "the trained model predicts at chance level (held-out accuracy" in said and "on 4 classes" in said, said
    assert "engines that agree with it prove little" in said


def test_a_model_that_learned_is_quiet(caplog: pytest.LogCaptureFixture) -> None:
    result = train(tiny_net(), tiny_data(), train_cfg(epochs=3))
    assert result.history[-1].val_accuracy > 0.5
    assert _warned(result, 10, math.log(10), caplog) == ""


def test_without_held_out_accuracy_a_loss_near_ln_classes_is_said(caplog: pytest.LogCaptureFixture) -> None:
    result = TrainResult(history=[EpochMetrics(1, 1.40, 1.0, 4, 1e-3), EpochMetrics(2, 1.37, 1.0, 4, 1e-3)])
    said = _warned(result, 4, math.log(4), caplog)
    assert "final training loss 1.37, the ln(4) = 1.386 of uniform scores" in said, said


def test_regression_or_a_users_loss_is_quiet(caplog: pytest.LogCaptureFixture) -> None:
    result = TrainResult(history=[EpochMetrics(1, 1.4, 1.0, 4, 1e-3, val_loss=1.4, val_accuracy=0.25)])
    assert _warned(result, 4, None, caplog) == ""
