"""A two-layer BERT written by hand (not Kiln's), exported by its user to ONNX: `python handbert.py` writes
bert_hand.onnx; `load` is its data (token ids and a mask, 4 random labels)."""

import math

import numpy as np
import torch
from torch import nn

from kiln import DatasetSplits

V, D, H, L, C = 1000, 128, 4, 2, 4


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.o = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.ff1, self.ff2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x, bias):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, H, D // H).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(D // H) + bias
        y = (att.softmax(-1) @ v).transpose(1, 2).reshape(b, s, D)
        x = self.ln1(x + self.o(y))
        return self.ln2(x + self.ff2(torch.nn.functional.gelu(self.ff1(x))))


class HandBert(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.pos = nn.Embedding(V, D), nn.Embedding(512, D)
        self.layers = nn.ModuleList(Layer() for _ in range(L))
        self.head = nn.Linear(D, C)

    def forward(self, input_ids, attention_mask):
        s = input_ids.shape[1]
        x = self.tok(input_ids) + self.pos(torch.arange(s, device=input_ids.device))[None]
        bias = (1.0 - attention_mask[:, None, None, :].float()) * -1e4
        for layer in self.layers:
            x = layer(x, bias)
        return x, self.head(x[:, 0])


def load() -> DatasetSplits:
    g = np.random.default_rng(0)
    n, s = 640, 64
    ids = g.integers(1, V, size=(n, s)).astype(np.int64)
    lens = g.integers(8, s + 1, size=n)
    mask = (np.arange(s)[None] < lens[:, None]).astype(np.int64)
    ids = ids * mask
    y = torch.from_numpy(g.integers(0, C, size=n))
    x = {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask)}
    tr = {k: v[:512] for k, v in x.items()}
    va = {k: v[512:] for k, v in x.items()}
    return DatasetSplits(tr, y[:512], va, y[512:], num_classes=C)


if __name__ == "__main__":
    torch.manual_seed(0)
    ids, mask = torch.randint(1, V, (2, 16)), torch.ones(2, 16, dtype=torch.long)
    axes = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}}
    torch.onnx.export(
        HandBert().eval(),
        (ids, mask),
        "bert_hand.onnx",
        input_names=["input_ids", "attention_mask"],
        output_names=["hidden", "logits"],
        dynamo=False,
        opset_version=17,
        dynamic_axes={**axes, "hidden": {0: "batch", 1: "seq"}, "logits": {0: "batch"}},
    )
