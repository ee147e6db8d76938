"""The dataset contract every stage reads: what a user's data function returns."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DatasetSplits:
    """Train and held-out tensors. ``x`` is the model's single input, ``y`` integer class labels."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    val_x: torch.Tensor
    val_y: torch.Tensor
    num_classes: int
    name: str = "dataset"

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one sample, without the batch axis."""
        return tuple(self.val_x.shape[1:])
