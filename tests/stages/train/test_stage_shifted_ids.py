"""Ids the model shifts by a constant before its lookup (one table, an offset per column: FT-Transformer's
``emb(x_cat + offsets)``) are checked against the table's rows before training, as ids looked up directly are."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kiln.core.data import DataContractError, DatasetSplits
from kiln.stages.train.stage import check_model_fits_data

CARDS = (4, 6, 3)  # a table of 13 rows; column 2's ids start at row 10


class Offsets(nn.Module):
    """Categorical columns sharing one table, each shifted by the rows of the columns before it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("offsets", torch.tensor((0, *CARDS[:-1])).cumsum(0))
        self.emb, self.head = nn.Embedding(sum(CARDS), 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(x + self.offsets).mean(1))


class OneBased(Offsets):
    """Ids counted from 1, shifted back by a number."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(x[:, 0] - 1))


class FromData(Offsets):
    """An offset computed from the data itself: not a constant, so not checked."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(x - x.min(0, keepdim=True).values).mean(1))


class Clamped(Offsets):
    """Shifted ids clamped in place before the lookup: not the data's ids plus the offset, so not checked."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = x + self.offsets
        ids.clamp_(max=sum(CARDS) - 1)
        return self.head(self.emb(ids).mean(1))


def _data(val: torch.Tensor) -> DatasetSplits:
    train = torch.tensor([[1, 1, 2], [3, 5, 0], [1, 2, 1]])
    return DatasetSplits(train, torch.tensor([0, 1, 0]), val, torch.zeros(len(val), dtype=torch.long), name="t:load")


def test_a_held_out_id_past_the_shared_table_is_named_before_training() -> None:
    val = torch.tensor([[0, 1, 2], [1, 1, 1], [2, 0, 4]])  # row 2, column 2: 4 + 10 = 14, past the 13 rows
    with pytest.raises(DataContractError) as e:
        check_model_fits_data(Offsets(), _data(val), "t:build")
    assert "val_x[..., 2] holds value 4 at row 2, which the model shifts by 10 to id 14, past the 13 rows" in str(
        e.value
    )
    assert "keep val_x[..., 2] within 0..2" in (e.value.hint or "")


def test_a_number_subtracted_from_a_column_is_checked() -> None:
    val = torch.tensor([[1, 0, 0], [0, 0, 0]])  # row 1: id 0 - 1 = -1, below the table
    with pytest.raises(DataContractError, match=r"val_x\[\.\.\., 0\] holds value 0 at row 1, .* to id -1, below"):
        check_model_fits_data(OneBased(), _data(val), "t:build")


def test_shifted_ids_within_the_table_pass() -> None:
    check_model_fits_data(Offsets(), _data(torch.tensor([[3, 5, 2], [0, 0, 0]])), "t:build")


@pytest.mark.parametrize("model", [FromData, Clamped])
def test_ids_not_shifted_by_a_constant_are_not_checked(model: type[nn.Module]) -> None:
    val = torch.tensor([[0, 1, 2], [1, 1, 1], [2, 0, 4]])
    check_model_fits_data(model(), _data(val), "t:build")


class Sliced(Offsets):
    """A run of columns sliced from the input, each shifted by its own offset."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(x[:, 1:3] + self.offsets[1:]).mean(1))


class Tokens(nn.Module):
    """Token ids counted from 1, shifted back by a number before the lookup."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(5, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(x - 1).mean(1))


def test_each_column_of_a_shifted_slice_is_named_with_its_own_offset() -> None:
    val = torch.tensor([[0, 0, 0], [0, 5, 6]])  # row 1, column 2: 6 + 10 = 16, past the 13 rows
    with pytest.raises(DataContractError) as e:
        check_model_fits_data(Sliced(), _data(val), "t:build")
    assert "val_x[..., 2] holds value 6 at row 1, which the model shifts by 10 to id 16, past the 13 rows" in str(
        e.value
    )
    assert "keep val_x[..., 2] within 0..2 (the table's ids after the offset 10)" in (e.value.hint or "")


def test_shifted_token_ids_of_another_length_are_checked_whole() -> None:
    """A split whose rows are longer than the probe's is checked over every position, the column named."""
    train = torch.tensor([[1, 2, 3], [4, 5, 1]])
    val = torch.tensor([[1, 2, 3, 4, 5], [1, 1, 1, 1, 6]])  # row 1, position 4: 6 - 1 = 5, past the 5 rows
    data = DatasetSplits(train, torch.tensor([0, 1]), val, torch.tensor([0, 1]), name="t:load")
    with pytest.raises(DataContractError) as e:
        check_model_fits_data(Tokens(), data, "t:build")
    assert "val_x[..., 4] holds value 6 at row 1, which the model shifts by -1 to id 5, past the 5 rows" in str(e.value)
    assert "keep val_x[..., 4] within 1..5 (the table's ids after the offset -1)" in (e.value.hint or "")
