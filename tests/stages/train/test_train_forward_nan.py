"""A model whose forward makes NaN before any update (a softmax over a row that is all -inf) is told so, with the
fix in the model: not the learning rate, the precision or torch's attention fast path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from kiln.core.errors import TrainingError
from kiln.pipeline.config import config_from_dict
from kiln.pipeline.runner import load_dataset, settings_for
from kiln.pipeline.stage_list import stage_named
from kiln.stages.train.loop import train
from kiln.stages.train.stage import train_to
from tests.stages.train.train_helpers import tiny_data, train_cfg


class AllMasked(nn.Module):
    """Class logits weighted by a softmax over scores that are all masked to -inf: NaN at every output."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = torch.zeros(len(x), 1, device=x.device).masked_fill(
            torch.ones(len(x), 1, dtype=torch.bool), float("-inf")
        )
        return self.head(x.flatten(1)) * torch.softmax(scores, -1)


def all_masked() -> AllMasked:
    return AllMasked()


def _says_forward(err: TrainingError) -> None:
    assert "before any update: its forward makes them, not training" in str(err), str(err)
    assert "instead of -inf" in (err.hint or "") and "train.lr" not in (err.hint or ""), err.hint


def test_every_step_skipped_by_a_nan_forward_blames_the_forward(tmp_path: Path) -> None:
    """The stage's error after a run of skipped steps said 'lower train.lr, or use train.precision'."""
    cfg = config_from_dict(
        {
            "model": {"name": "tests.stages.train.test_train_forward_nan:all_masked"},
            "data": {"name": "synthetic", "params": {"size": 80}},
            "train": {"epochs": 1, "batch_size": 32, "device": "cpu", "plot": False, "checkpoint": {"resume": "never"}},
        }
    )
    with pytest.raises(TrainingError, match="no training step was taken") as err:
        train_to(tmp_path / "out", settings_for(stage_named("train"), cfg), load_dataset(cfg), tmp_path / "ck")
    _says_forward(err.value)


def test_a_nan_streak_from_the_first_step_blames_the_forward() -> None:
    """Past train.amp.nonfinite_patience the loop's own error: the forward, not the streak's learning rate."""
    with pytest.raises(TrainingError, match="consecutive steps since training started") as err:
        train(AllMasked(), tiny_data(), train_cfg(epochs=1, amp={"nonfinite_patience": 1}))
    _says_forward(err.value)
