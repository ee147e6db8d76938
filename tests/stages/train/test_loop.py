"""The training loop's error after a streak of non-finite steps names the cause it can tell, not the learning rate."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kiln.core.errors import TrainingError
from kiln.stages.train.loop import train
from kiln.stages.train.task import Task
from tests.stages.train.train_helpers import tiny_data, train_cfg


def nan_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A loss of the user's that is NaN for any outputs."""
    return nn.functional.cross_entropy(outputs, targets) * float("nan")


def test_a_user_loss_nan_from_the_first_step_is_blamed_not_the_learning_rate() -> None:
    """The streak's error said 'lower train.lr' where the user's loss was NaN for the model's finite outputs."""
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    cfg = train_cfg(epochs=1, loss="tests.stages.train.test_loop:nan_loss", amp={"nonfinite_patience": 1})
    with pytest.raises(TrainingError, match="since training started") as err:
        train(model, tiny_data(), cfg, task=Task("classification", None, nan_loss))
    assert "train.loss tests.stages.train.test_loop:nan_loss returns NaN" in str(err.value), str(err.value)
    assert "outputs are finite" in str(err.value)
    assert "train.lr" not in (err.value.hint or "") and "finite loss" in (err.value.hint or ""), err.value.hint
