"""Small models of the kinds users bring, shared by tests in several folders."""

from __future__ import annotations

import torch
from torch import nn


class BagModel(nn.Module):
    """A recommender-style model: summed embedding bags of token ids, then a linear head. Its export holds a Loop
    over the bags, which ONNX Runtime's FP16 converter cannot convert."""

    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(17, 8, mode="sum")
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bag(x))
