"""A tiny graph network in the batch-of-one layout docs/byom.md prescribes: ``x [1, nodes, F]`` and
``edge_index [1, 2, edges]``, a forward that reads row 0 only (``index_add_`` of each edge's source row into its
target) and returns ``[1, nodes, C]``, exported with a symbolic batch axis as Kiln's export makes it (the output's
axis 0 is then a fixed 1); and random graphs for it."""

from __future__ import annotations

import functools
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

FEATURES, CLASSES = 4, 3


class BatchOfOneGCN(nn.Module):
    """One message-passing layer over the edges of one graph: ``out = h + sum over edges (src -> dst) of h[src]``,
    ``h = x W`` with non-negative weights (positive inputs give positive outputs), and a ReLU at the end with
    ``relu`` (which changes only nodes whose outputs are negative)."""

    def __init__(self, relu: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(FEATURES, CLASSES)
        self.relu = relu
        with torch.no_grad():
            self.lin.weight.copy_(torch.linspace(0.1, 1.0, FEATURES * CLASSES).reshape(CLASSES, FEATURES))
            self.lin.bias.zero_()

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        h, edges = self.lin(x[0]), edge_index[0]
        out = torch.zeros_like(h).index_add_(0, edges[1], h[edges[0]]) + h
        return (torch.relu(out) if self.relu else out).unsqueeze(0)


@functools.cache
def _exported(relu: bool) -> bytes:
    """The module exported once per test session (the dynamo exporter: the TorchScript one exports ``index_add_``
    wrong for repeated targets)."""
    x, edges = torch.rand(2, 10, FEATURES), torch.randint(0, 10, (2, 2, 20))
    batch, nodes, count = torch.export.Dim("batch"), torch.export.Dim("nodes"), torch.export.Dim("edges")
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = Path(tmp) / "gcn.onnx"
        torch.onnx.export(
            BatchOfOneGCN(relu).eval(),
            (x, edges),
            str(path),
            input_names=["x", "edge_index"],
            output_names=["logits"],
            dynamic_shapes={"x": {0: batch, 1: nodes}, "edge_index": {0: batch, 2: count}},
            dynamo=True,
            external_data=False,
            verbose=False,
        )
        return path.read_bytes()


def gcn_onnx(path: Path, relu: bool = False) -> Path:
    """The exported :class:`BatchOfOneGCN` at ``path``: inputs ``[batch, nodes, 4]`` and ``[batch, 2, edges]``, its
    output ``[1, nodes, 3]``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(_exported(relu))
    return path


def graphs(count: int, nodes: int, edges: int, seed: int = 0) -> dict[str, np.ndarray]:
    """``count`` random graphs of ``nodes`` nodes and ``edges`` edges, one a row: features in [0.5, 1.5)."""
    rng = np.random.default_rng(seed)
    return {
        "x": (rng.random((count, nodes, FEATURES)) + 0.5).astype(np.float32),
        "edge_index": rng.integers(0, nodes, (count, 2, edges)).astype(np.int64),
    }
