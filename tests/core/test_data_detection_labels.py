"""Integer detection labels [N, M, 5] (class, x1, y1, x2, y2 in pixels) get an error that says to give them as float,
not one that reads their box coordinates as classes out of range."""

from __future__ import annotations

import pytest
import torch

from kiln.core.data import DataContractError, DatasetSplits, check_splits


def _boxes(n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    cls = torch.randint(0, 3, (n, 2, 1), generator=g)
    xy = torch.randint(0, 30, (n, 2, 2), generator=g)
    y = torch.cat([cls, xy, xy + 20], -1).to(dtype)
    y[:, 1, 0] = -1  # a padding row
    return y


def test_integer_detection_labels_are_asked_for_as_float() -> None:
    x, y = torch.zeros(8, 3, 8, 8), _boxes(8, torch.int64)
    with pytest.raises(DataContractError) as info:
        check_splits(DatasetSplits(x, y, x[:4], y[:4], num_classes=3), "det:load")
    assert "train_y is int64[8, 2, 5], detection labels (class, x1, y1, x2, y2)" in info.value.message
    assert (info.value.hint or "").startswith("give detection labels as float: train_y.float()")


def test_float_detection_labels_pass_and_integer_classes_out_of_range_keep_their_error() -> None:
    x, y = torch.zeros(8, 3, 8, 8), _boxes(8, torch.float32)
    check_splits(DatasetSplits(x, y, x[:4], y[:4], num_classes=3), "det:load")
    bad = _boxes(8, torch.int64)
    bad[0, 0, 0] = 7  # a class out of range: not taken for detection labels
    with pytest.raises(DataContractError) as info:
        check_splits(DatasetSplits(x, bad, x[:4], bad[:4], num_classes=3), "det:load")
    assert info.value.hint == "fix the labels or num_classes"
