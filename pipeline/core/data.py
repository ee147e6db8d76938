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

    def inconsistency(self) -> str | None:
        """What makes these splits unusable, or None. Checked before any training: rows without labels, or
        held-out samples of another shape than the training ones, would otherwise export a model of the wrong
        shape and validate it on data it was never meant for."""
        for split in ("train", "val"):
            x, y = getattr(self, f"{split}_x"), getattr(self, f"{split}_y")
            if x.ndim < 1 or len(x) == 0:
                return f"{split}_x holds no samples"
            if y.ndim != 1 or len(y) != len(x):
                return f"{split}_x has {len(x)} rows but {split}_y has shape {list(y.shape)} (one label per row expected)"
            if y.dtype.is_floating_point or y.dtype.is_complex or y.dtype == torch.bool:
                return f"{split}_y holds {y.dtype}, not integer class labels"
            if not isinstance(self.num_classes, int) or self.num_classes < 1:
                return f"num_classes is {self.num_classes!r}, not a positive integer"
            if int(y.min()) < 0 or int(y.max()) >= self.num_classes:
                return (f"{split}_y has labels from {int(y.min())} to {int(y.max())}, outside 0..{self.num_classes - 1} "
                        f"(num_classes {self.num_classes})")
        if self.train_x.shape[1:] != self.val_x.shape[1:]:
            return (f"validation samples are {list(self.val_x.shape[1:])} but training samples are "
                    f"{list(self.train_x.shape[1:])}")
        if self.train_x.dtype != self.val_x.dtype:
            return f"train_x is {self.train_x.dtype} but val_x is {self.val_x.dtype}"
        return None

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one sample, without the batch axis."""
        return tuple(self.val_x.shape[1:])
