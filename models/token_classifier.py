"""A small transformer over padded token ids: ``forward(input_ids, attention_mask) -> (hidden, logits)``.

The zoo's two-input, two-output model (the shape of a HuggingFace encoder): integer inputs, a padding mask,
a variable sequence length, and a hidden-state output besides the class logits. Attention is written out
with the mask added to the scores (no fused kernel), so training and the exported graph compute alike.
"""

from __future__ import annotations

import math

import torch
from torch import nn

MASKED = -1e4  # added to scores of padding: exp() underflows to 0 in FP32 and FP16 alike, no -inf NaNs


class MaskedEncoderLayer(nn.Module):
    def __init__(self, dim: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, ffn), nn.GELU(), nn.Linear(ffn, dim))

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (p(x).reshape(b, s, self.heads, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim) + bias
        ctx = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, d)
        x = self.norm1(x + self.out(ctx))
        return self.norm2(x + self.ff(x))


class TokenClassifier(nn.Module):
    def __init__(
        self,
        vocab_size: int = 64,
        max_len: int = 64,
        num_classes: int = 4,
        dim: int = 32,
        heads: int = 2,
        layers: int = 2,
        ffn: int | None = None,
    ) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} must be divisible by heads {heads}")
        self.tokens = nn.Embedding(vocab_size, dim)
        self.positions = nn.Embedding(max_len, dim)
        self.layers = nn.ModuleList(MaskedEncoderLayer(dim, heads, ffn or 4 * dim) for _ in range(layers))
        self.head = nn.Linear(dim, num_classes)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        h = self.tokens(input_ids) + self.positions(positions)
        mask = attention_mask.to(h.dtype)
        bias = ((1.0 - mask) * MASKED)[:, None, None, :]  # [B, 1, 1, S]: padding takes no attention
        for layer in self.layers:
            h = layer(h, bias)
        pooled = (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True).clamp(min=1.0)  # mean over real tokens
        return h, self.head(pooled)


def token_classifier(**kw: object) -> TokenClassifier:
    return TokenClassifier(**kw)  # type: ignore[arg-type]


class MLPRegressor(nn.Module):
    """Float features in, ``outputs`` float targets out: the zoo's regression model (no classes)."""

    def __init__(self, in_features: int = 8, hidden: int = 32, outputs: int = 1) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(in_features, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, outputs)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def mlp_regressor(**kw: object) -> MLPRegressor:
    return MLPRegressor(**kw)  # type: ignore[arg-type]
