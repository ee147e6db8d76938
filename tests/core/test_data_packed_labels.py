"""Integer labels [N, K] whose column 0 holds classes and whose other columns do not (a class, an age, attributes
packed in one tensor) get an error that says several targets a sample go in one float tensor, not one that reads
them as classes per position with -100 marking positions without a label."""

from __future__ import annotations

import pytest
import torch

from kiln.core.data import DataContractError, DatasetSplits, check_splits
from kiln.core.labels import IGNORE_LABEL


def _packed(n: int) -> torch.Tensor:
    """(class 0..4, age 0..80, 4 binary attributes) per sample, as int64."""
    g = torch.Generator().manual_seed(0)
    cls, age = torch.randint(0, 5, (n, 1), generator=g), torch.randint(0, 81, (n, 1), generator=g)
    return torch.cat([cls, age, torch.randint(0, 2, (n, 4), generator=g)], 1)


def _error(y: torch.Tensor) -> DataContractError:
    x = torch.zeros(len(y), 3)
    with pytest.raises(DataContractError) as info:
        check_splits(DatasetSplits(x, y, x[:4], y[:4], num_classes=5), "mt:load")
    return info.value


def test_packed_integer_targets_are_asked_for_as_one_float_tensor() -> None:
    exc = _error(_packed(32))
    assert "train_y is int64[32, 6]: column 0 holds classes 0..4, columns 1-5 values from 0 to" in exc.message
    assert str(IGNORE_LABEL) not in exc.message, exc.message
    assert "one float tensor" in (exc.hint or "") and "torch.cat([cls[:, None].float(), age[:, None], attrs], 1)" in (
        exc.hint or ""
    )


def test_labels_per_position_keep_their_errors() -> None:
    """A class out of range in column 0, or one value outside the classes (an ignore mark), is no packed target."""
    bad = _packed(32)
    bad[0, 0] = 9
    assert _error(bad).hint == "fix the labels or num_classes"
    tokens = torch.randint(0, 5, (32, 6), generator=torch.Generator().manual_seed(1))
    tokens[:, 4:] = 255  # a dataset's own "no label" mark
    assert "map it to -100" in (_error(tokens).hint or "")
