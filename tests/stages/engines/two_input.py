"""A tiny BERT-like model with two inputs (token ids and attention mask), exported the way HF users do
(``torch.onnx.export(..., dynamo=True)`` with a dynamic batch on both inputs): the shape of issue 12's BERT-base."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from torch import nn

SEQ, VOCAB, HIDDEN = 16, 50, 32


class TinyBert(nn.Module):
    def __init__(self, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.emb, self.pos = nn.Embedding(VOCAB, HIDDEN), nn.Parameter(torch.randn(SEQ, HIDDEN) * 0.02)
        self.qkv, self.proj = nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.ln1, self.ln2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.ffn = nn.Sequential(nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(), nn.Linear(4 * HIDDEN, HIDDEN))
        self.head = nn.Linear(HIDDEN, 2)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        b, s = input_ids.shape
        h = self.ln1(self.emb(input_ids) + self.pos[:s])
        q, k, v = self.qkv(h).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        bias = (1.0 - attention_mask[:, None, None, :].to(h.dtype)) * -10000.0
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias, dim=-1)
        h = self.ln2(h + self.proj((att @ v).transpose(1, 2).reshape(b, s, HIDDEN)))
        h = h + self.ffn(h)
        return self.head(torch.tanh(h[:, 0]))


def feeds(batch: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    mask = np.ones((batch, SEQ), np.int64)
    mask[:, SEQ // 2 :] = rng.integers(0, 2, size=(batch, SEQ - SEQ // 2))
    return {"input_ids": rng.integers(0, VOCAB, size=(batch, SEQ), dtype=np.int64), "attention_mask": mask}


def export_two_input(path: Path) -> Path:
    torch.manual_seed(0)
    model = TinyBert().eval()
    x = {k: torch.from_numpy(v) for k, v in feeds(2).items()}
    batch = torch.export.Dim("batch", min=1, max=64)
    torch.onnx.export(
        model,
        (x["input_ids"], x["attention_mask"]),
        str(path),
        dynamo=True,
        input_names=["input_ids", "attention_mask"],
        output_names=["logits"],
        dynamic_shapes={"input_ids": {0: batch}, "attention_mask": {0: batch}},
    )
    return path
