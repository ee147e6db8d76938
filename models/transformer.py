"""Transformer encoder classifier with explicit Q/K/V projections, LayerNorm and GELU.

Attention is written out (MatMul, scale, Softmax, MatMul) instead of ``nn.MultiheadAttention`` so the
exported graph shows the patterns Kiln's optimizer and ONNX Runtime's attention fusion work on (QKV merge,
LayerNorm, GELU). Outside ONNX export the same function runs through ``F.scaled_dot_product_attention``: on a
GPU that is one flash/memory-efficient kernel instead of four ops and a [B, H, S, S] score tensor kept for the
backward pass, which is most of the gap between FP32 and AMP training speed on an encoder.
``attention="explicit"`` keeps the four ops in training too (what ``torch.compile`` has to fuse by itself;
benchmarks/train_bench.py compares both).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, explicit: bool = False) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} must be divisible by heads {heads}")
        self.heads, self.head_dim, self.explicit = heads, dim // heads, explicit
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        return x.reshape(b, s, self.heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self._split(self.q(x)), self._split(self.k(x)), self._split(self.v(x))
        if self.explicit or torch.onnx.is_in_onnx_export():
            ctx = explicit_attention(q, k, v)
        else:
            ctx = F.scaled_dot_product_attention(q, k, v)  # same function, fused kernel
        return self.out(ctx.transpose(1, 2).reshape(b, s, d))


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v as separate ops: the pattern exported to ONNX."""
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    return torch.matmul(torch.softmax(scores, dim=-1), v)


class EncoderLayer(nn.Module):
    def __init__(self, dim: int, heads: int, ffn: int, explicit: bool = False) -> None:
        super().__init__()
        self.attn = SelfAttention(dim, heads, explicit)
        self.norm1 = nn.LayerNorm(dim)
        self.ff1 = nn.Linear(dim, ffn)
        self.act = nn.GELU()
        self.ff2 = nn.Linear(ffn, dim)
        self.norm2 = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm1(x + self.attn(x))  # post-norm, as in BERT
        return self.norm2(x + self.ff2(self.act(self.ff1(x))))


class TransformerClassifier(nn.Module):
    """Input ``[B, S, F]`` float features (e.g. image rows as tokens); mean-pooled classifier head.

    ``input_kind="image"`` accepts ``[B, 1, H, W]`` and treats the H rows as tokens of W features.
    """

    def __init__(
        self,
        in_features: int = 8,
        seq_len: int = 8,
        num_classes: int = 10,
        dim: int = 64,
        heads: int = 4,
        layers: int = 2,
        ffn: int | None = None,
        input_kind: str = "image",
        attention: str = "sdpa",
    ) -> None:
        super().__init__()
        if input_kind not in ("image", "tokens"):
            raise ValueError(f"input_kind must be 'image' or 'tokens', got {input_kind!r}")
        if attention not in ("sdpa", "explicit"):
            raise ValueError(f"attention must be 'sdpa' or 'explicit', got {attention!r}")
        self.input_kind = input_kind
        self.embed = nn.Linear(in_features, dim)
        self.pos = nn.Parameter(torch.zeros(1, seq_len, dim))
        nn.init.normal_(self.pos, std=0.02)
        self.layers = nn.ModuleList(
            EncoderLayer(dim, heads, ffn or 4 * dim, attention == "explicit") for _ in range(layers)
        )
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_kind == "image":
            x = x.flatten(1, 2)  # [B, 1, H, W] -> [B, H, W]
        h = self.embed(x) + self.pos
        for layer in self.layers:
            h = layer(h)
        return self.head(h.mean(dim=1))


def transformer(**kw: object) -> TransformerClassifier:
    return TransformerClassifier(**kw)  # type: ignore[arg-type]


def bert_base(**kw: object) -> TransformerClassifier:
    """BERT-base shape: 12 layers, hidden 768, 12 heads, FFN 3072, sequence 128 of 768 features."""
    defaults: dict[str, object] = dict(
        in_features=768, seq_len=128, num_classes=2, dim=768, heads=12, layers=12, ffn=3072, input_kind="tokens"
    )
    defaults.update(kw)
    return TransformerClassifier(**defaults)  # type: ignore[arg-type]
