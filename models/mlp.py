"""Recommender-style model: one embedding per categorical field, concatenated, then an MLP.

On the digits data each of the 64 pixels is a field and its intensity (0..16) the category, so the model
learns a real task while having the shape of a CTR model (int64 ids -> Gather -> MLP).
"""

from __future__ import annotations

import torch
from torch import nn


class EmbeddingMLP(nn.Module):
    """Input ``[B, num_fields]`` int64 category ids, each in ``[0, cardinality)``."""

    def __init__(
        self,
        num_fields: int = 64,
        cardinality: int = 17,
        embed_dim: int = 8,
        hidden: tuple[int, ...] = (128, 64),
        num_classes: int = 10,
    ) -> None:
        super().__init__()
        self.cardinality = cardinality
        # One shared table with a per-field offset: the usual trick for many small fields.
        self.embedding = nn.Embedding(num_fields * cardinality, embed_dim)
        self.register_buffer("offsets", torch.arange(num_fields, dtype=torch.long) * cardinality, persistent=False)
        layers: list[nn.Module] = []
        cin = num_fields * embed_dim
        for h in hidden:
            layers += [nn.Linear(cin, h), nn.ReLU()]
            cin = h
        self.mlp = nn.Sequential(*layers)
        self.head = nn.Linear(cin, num_classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        emb = self.embedding(ids + self.offsets)
        return self.head(self.mlp(emb.flatten(1)))


def mlp_embed(**kw: object) -> EmbeddingMLP:
    return EmbeddingMLP(**kw)  # type: ignore[arg-type]
