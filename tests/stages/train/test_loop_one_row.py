"""A batch of one row reaching BatchNorm in training: the fix names the batch size, not the model's forward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kiln.core.errors import KilnError
from kiln.stages.train.loop import train
from tests.stages.train.train_helpers import tiny_data, train_cfg


class BatchNormed(nn.Module):
    """A classifier of the synthetic 8x8 images with a BatchNorm layer, its forward the user's own code."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def test_a_last_batch_of_one_row_beside_batchnorm_is_told_to_change_the_batch_size() -> None:
    data = tiny_data(200)  # 160 training rows: batches of 53 leave one row for the last
    with pytest.raises(KilnError) as caught:
        train(BatchNormed(), data, train_cfg(epochs=1, batch_size=53))
    assert "Expected more than 1 value per channel" in caught.value.message
    assert (caught.value.hint or "").startswith("a batch of one row reached BatchNorm"), caught.value.hint
