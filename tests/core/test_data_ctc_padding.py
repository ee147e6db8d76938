"""The padding docs/byom.md gives CTC label sequences is the one the data check takes (``IGNORE_LABEL``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from kiln.core.data import DataContractError, DatasetSplits, check_splits
from kiln.core.labels import IGNORE_LABEL

BYOM = Path(__file__).resolve().parents[2] / "docs" / "byom.md"


def _padded(pad: int) -> DatasetSplits:
    """CTC label sequences of 2 to 5 classes of 11, ``pad`` past each row's end."""
    y = torch.full((4, 5), pad, dtype=torch.long)
    for i in range(4):
        y[i, : 2 + i % 4] = torch.arange(1, 3 + i % 4)
    return DatasetSplits(torch.zeros(4, 1, 8, 16), y, torch.zeros(4, 1, 8, 16), y, num_classes=11)


def test_the_documented_ctc_padding_passes_the_data_check() -> None:
    """The docs said -1, which the data check refuses: it takes only IGNORE_LABEL (-100)."""
    text = " ".join(BYOM.read_text().split())
    said = re.search(r"padded into one tensor, `(-?\d+)` past each row's end", text)
    assert said is not None and int(said.group(1)) == IGNORE_LABEL
    assert f"(targets != {IGNORE_LABEL}).sum(1)" in text
    check_splits(_padded(int(said.group(1))), "crnn:load")
    with pytest.raises(DataContractError):
        check_splits(_padded(-1), "crnn:load")
