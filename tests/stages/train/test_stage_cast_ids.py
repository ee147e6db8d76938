"""A float timestep the model casts to ids (``self.table(t.long())``) is checked against the embedding's rows before
training, as an integer one is, truncated as the cast truncates it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kiln.core.data import DataContractError, DatasetSplits
from kiln.stages.train.stage import check_model_fits_data


class StepTable(nn.Module):
    """A learned timestep table looked up through a cast of the float timestep."""

    def __init__(self, steps: int = 10) -> None:
        super().__init__()
        self.table, self.lin = nn.Embedding(steps, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.table(t.long())


class Scaled(StepTable):
    """A float noise level in 0..1 scaled before the cast: not the data's values, so not checked."""

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.table((t * 9).long())


def _data(t: torch.Tensor) -> DatasetSplits:
    x = {"x": torch.randn(len(t), 4), "t": t}
    return DatasetSplits(x, torch.randn(len(t), 4), x, torch.randn(len(t), 4), name="steps:load")


def test_a_float_timestep_past_the_table_is_named_before_training() -> None:
    t = torch.tensor([1.0, 2.0, 3.0, 12.0, 4.0])  # row 3 past the 10 rows; the probe's two rows are within
    with pytest.raises(DataContractError) as e:
        check_model_fits_data(StepTable(), _data(t), "steps:build")
    assert "train_x['t'] holds token id 12 at row 3, past the 10 rows of the model's embedding 'table'" in str(e.value)


def test_whole_float_timesteps_within_the_table_pass() -> None:
    check_model_fits_data(StepTable(), _data(torch.tensor([1.0, 2.0, 9.0, 0.0])), "steps:build")


def test_a_float_the_model_scales_before_its_cast_is_not_checked() -> None:
    check_model_fits_data(Scaled(), _data(torch.tensor([0.0, 1.0, 0.5, 0.25])), "steps:build")
