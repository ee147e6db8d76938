"""The class-logit output of a run with labels: one-hot float labels are class labels, other float targets not."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kiln.core.output_names import class_logits, one_hot


def _one_hot_rows() -> torch.Tensor:
    return F.one_hot(torch.arange(12) % 10, 10).float()


def test_one_hot_float_labels_keep_the_default_class_logits() -> None:
    assert class_logits(["logits"], None, _one_hot_rows()) == "logits"
    assert class_logits(["logits"], None, _one_hot_rows(), num_classes=10) == "logits"


def test_one_hot_labels_per_pixel_and_per_token_are_class_labels() -> None:
    pixels = F.one_hot(torch.randint(0, 3, (2, 4, 4)), 3).permute(0, 3, 1, 2).float()  # [N, C, H, W]
    tokens = F.one_hot(torch.randint(0, 5, (2, 7)), 5).float()  # [N, seq, C]
    assert one_hot(pixels, 3) and one_hot(tokens.numpy(), 5)


@pytest.mark.parametrize(
    "labels, num_classes",
    [
        (_one_hot_rows(), 5),  # another width than the data's classes
        (torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 0.0]]), 0),  # multi-hot: a multi-label head's
        (torch.tensor([[0.7, 0.3], [0.2, 0.8]]), 0),  # soft scores
        (torch.rand(4, 3), 0),  # a regression's values
        (torch.tensor([[1.0], [0.0]]), 0),  # one column: a binary rate
        (np.array([[0, 1], [1, 0]], dtype=np.int64), 0),  # not float
    ],
)
def test_other_targets_are_no_one_hot_class_labels(labels: torch.Tensor | np.ndarray, num_classes: int) -> None:
    assert not one_hot(labels, num_classes)


def test_float_targets_leave_no_default_class_logits_but_a_named_one() -> None:
    values = torch.rand(4, 3)
    assert class_logits(["logits"], None, values) is None
    assert class_logits(["logits"], "logits", values) == "logits"
    assert class_logits(["logits"], None, torch.arange(4)) == "logits"
