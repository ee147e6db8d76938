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


class TwoIn(nn.Module):
    """Two float inputs, by position: features and a small side vector."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 4), nn.Linear(3, 4)

    def forward(self, x: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(meta)


class IdsAndMask(nn.Module):
    """Token ids and an attention mask, both integers: a text model's pair."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(20, 8), nn.Linear(8, 2)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        mask = attention_mask.unsqueeze(-1).float()
        return self.head((self.emb(input_ids) * mask).sum(1) / mask.sum(1).clamp(min=1))


class ThreeIn(nn.Module):
    """An image, a vector and a scalar per sample."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.vec = nn.Conv2d(3, 4, 3), nn.Linear(5, 4)

    def forward(self, image: torch.Tensor, vec: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.conv(image).mean((2, 3)) * scale + self.vec(vec)


def two_in() -> TwoIn:
    return TwoIn()


def ids_and_mask() -> IdsAndMask:
    return IdsAndMask()


def three_in() -> ThreeIn:
    return ThreeIn()
