"""The check before training of the ids an input's columns index: a layout model (LayoutLM's way) looks up each
coordinate of its ``bbox`` [N, T, 4] in a table by column (``bbox[:, :, 0]``), and a value past the table in a row
the probe did not take is named with its input, column and row, not met as an IndexError at that row's step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kiln.core.data import DataContractError, DatasetSplits
from kiln.stages.train.stage import check_model_fits_data
from kiln.stages.train.task import Task


class Boxes(nn.Module):
    """Tokens with boxes [N, T, 4] (x0, y0, x1, y1 in 0..31): x0 and x1 in one table, y0 and y1 (a slice of the
    two columns 1:3 here, to cover a run of columns) in another, the width from the difference."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.x_emb, self.y_emb, self.w_emb = (nn.Embedding(32, 8) for _ in range(4))
        self.head = nn.Linear(8, 2)

    def forward(self, input_ids: torch.Tensor, bbox: torch.Tensor) -> torch.Tensor:
        h = self.emb(input_ids) + self.x_emb(bbox[:, :, 0]) + self.x_emb(bbox[:, :, 3])
        h = h + self.y_emb(bbox[..., 1:3]).sum(2) + self.w_emb((bbox[..., 3] - bbox[..., 0]).clamp(0, 31))
        return self.head(h.mean(1))


class Folded(Boxes):
    """Each coordinate folded into its table's rows before the lookup: any value is fine."""

    def forward(self, input_ids: torch.Tensor, bbox: torch.Tensor) -> torch.Tensor:
        folded = bbox % 32
        return self.head((self.emb(input_ids) + self.x_emb(folded[:, :, 0]) + self.y_emb(folded[..., 1])).mean(1))


def _data(split: str, row: int, column: int, value: int) -> DatasetSplits:
    """12 rows of ids and boxes within 0..31 (8 to train on), one box coordinate set to ``value``."""
    g = torch.Generator().manual_seed(0)
    x = {"input_ids": torch.randint(0, 32, (12, 6), generator=g), "bbox": torch.randint(0, 16, (12, 6, 4), generator=g)}
    x["bbox"][..., 3] += 16  # x1 past x0: a box of positive width
    train = {k: v[:8].clone() for k, v in x.items()}
    val = {k: v[8:].clone() for k, v in x.items()}
    (train if split == "train" else val)["bbox"][row, 2, column] = value
    y = torch.arange(12) % 2
    return DatasetSplits(train, y[:8], val, y[8:], num_classes=2, name="boxes:load")


@pytest.mark.parametrize(
    ("split", "row", "column", "value", "side"),
    [("train", 5, 3, 40, "past the 32 rows"), ("val", 2, 2, -1, "below the first of the 32 rows")],
)
def test_a_value_past_a_table_in_a_column_the_model_looks_up_is_named_before_training(
    split: str, row: int, column: int, value: int, side: str
) -> None:
    """A selected column (``bbox[:, :, 3]``) and one of a sliced run (``bbox[..., 1:3]``)."""
    table = "x_emb" if column == 3 else "y_emb"
    with pytest.raises(DataContractError) as e:
        check_model_fits_data(Boxes(), _data(split, row, column, value), "boxes:build", Task("classification"))
    assert e.value.message == (
        f"dataset 'boxes:load': {split}_x['bbox'][..., {column}] holds value {value} at row {row}, {side} of the "
        f"model's embedding '{table}' (a table of 32 x 8: ids 0..31)"
    )
    assert e.value.hint.startswith(f"keep {split}_x['bbox'][..., {column}] within 0..31")


def test_columns_the_model_maps_before_its_lookup_are_not_checked() -> None:
    """No false alarm where the lookup takes a column of a new tensor: the boxes folded into the tables first."""
    check_model_fits_data(Folded(), _data("train", 5, 0, 40), "boxes:build", Task("classification"))
