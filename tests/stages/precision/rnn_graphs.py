"""Tiny recurrent classifiers exported from PyTorch (``nn.LSTM`` / ``nn.GRU`` -> ONNX's LSTM / GRU ops), and
calibration data for them: what ``kiln precision FILE`` gets for a recurrent model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

FEATURES, HIDDEN, CLASSES, SEQ = 4, 12, 3, 6


class RecurrentClassifier(nn.Module):
    """A 2-layer recurrent encoder (``cell``: ``nn.LSTM`` or ``nn.GRU``), mean-pooled over time, then a linear head."""

    def __init__(self, cell: type[nn.Module]) -> None:
        super().__init__()
        self.rnn = cell(FEATURES, HIDDEN, num_layers=2, batch_first=True)
        self.head = nn.Linear(HIDDEN, CLASSES)
        with torch.no_grad():  # logits far apart: int8's small error must not flip a random model's top-1
            self.head.weight.mul_(8.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(x)
        return self.head(h.mean(1))


def rnn_classifier(path: Path, cell: type[nn.Module]) -> Path:
    """The classifier exported to ``path`` (input ``x [batch, seq, 4]``, output ``logits``; TorchScript exporter,
    which writes ONNX's own LSTM/GRU op), seeded."""
    torch.manual_seed(0)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.onnx.export(
        RecurrentClassifier(cell).eval(),
        (torch.rand(2, SEQ, FEATURES),),
        str(path),
        input_names=["x"],
        output_names=["logits"],
        dynamic_axes={"x": {0: "batch", 1: "seq"}, "logits": {0: "batch"}},
        dynamo=False,
    )
    return path


def rnn_data(path: Path, rows: int = 64) -> Path:
    """Calibration data for the classifier: ``x`` of ``rows`` rows, ``SEQ`` steps."""
    rng = np.random.default_rng(1)
    np.savez(path, x=rng.standard_normal((rows, SEQ, FEATURES)).astype(np.float32))
    return path
