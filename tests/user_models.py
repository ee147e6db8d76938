"""Small models of the kinds users bring, shared by tests in several folders."""

from __future__ import annotations

import torch
from torch import nn

from kiln.core.data import DatasetSplits


class BagModel(nn.Module):
    """A recommender-style model: summed embedding bags of token ids, then a linear head. The bags go to the
    module as flat ids with offsets, the form whose export holds a Loop over the bags (padded ``[N, L]`` ids
    export as a lookup and a sum: kiln.stages.export.bags), which ONNX Runtime's FP16 converter cannot convert."""

    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(17, 8, mode="sum")
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        offsets = torch.arange(0, x.numel(), x.shape[1], device=x.device)
        return self.head(self.bag(x.flatten(), offsets))


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


class TokenIds(nn.Module):
    """A head that answers token ids only (an argmax past 2**24, where float32 stops holding every integer): an
    output compared value for value, not by cosine."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 6)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"token_id": self.head(x).argmax(-1) + 2**24 + 1}


def token_ids() -> TokenIds:
    return TokenIds()


def two_in() -> TwoIn:
    return TwoIn()


def ids_and_mask() -> IdsAndMask:
    return IdsAndMask()


def three_in() -> ThreeIn:
    return ThreeIn()


def _splits(x: dict[str, torch.Tensor] | tuple[torch.Tensor, ...], rows: int = 24) -> DatasetSplits:
    take = (lambda s: {k: v[s] for k, v in x.items()}) if isinstance(x, dict) else (lambda s: tuple(v[s] for v in x))
    y = torch.zeros(rows, dtype=torch.long)
    return DatasetSplits(take(slice(0, 16)), y[:16], take(slice(16, rows)), y[16:], num_classes=2)


def two_in_data(as_tuple: bool = False) -> DatasetSplits:
    """Data for :class:`TwoIn`, as a dict by name or a tuple in the forward's order."""
    g = torch.Generator().manual_seed(0)
    x, meta = torch.rand(24, 8, generator=g), torch.rand(24, 3, generator=g)
    return _splits((x, meta) if as_tuple else {"x": x, "meta": meta})


def ids_and_mask_data() -> DatasetSplits:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 20, (24, 6), generator=g)
    return _splits({"input_ids": ids, "attention_mask": torch.ones_like(ids)})


def three_in_data() -> DatasetSplits:
    g = torch.Generator().manual_seed(0)
    image, vec, scale = torch.rand(24, 3, 6, 6, generator=g), torch.rand(24, 5, generator=g), torch.ones(24, 1)
    return _splits({"image": image, "vec": vec, "scale": scale})
