"""A graph network in the batch-of-one layout (docs/byom.md) whose training graphs are smaller than its held-out
ones: validation's default smallest size is the training graphs', which Kiln makes by cutting a held-out graph,
keeping edges to the nodes it cut away. The export's error says where that size came from and suggests sizes Kiln
makes without cutting (the held-out graphs' own and twice it), which the model runs at and then pass."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from torch import nn

from kiln.cli import main
from kiln.core.data import DatasetSplits
from kiln.core.errors import ModelError
from kiln.core.onnx_io import ort_session
from kiln.stages.export.sizes import check_validated_sizes
from kiln.stages.export.torch_export import export_onnx
from tests.core.test_ownership import one_error

HERE = "tests.stages.export.test_sizes_cut_graphs"
AXES = {"x": {1: "nodes"}, "edge_index": {2: "edges"}}
# the sizes the fix suggests for held-out graphs of 9 nodes and 18 edges: their own and twice it
SUGGESTED = {"edges": [18, 36], "nodes": [9, 18]}


class MessagePassing(nn.Module):
    """Each node's features summed over its in-edges (``index_add_``), one graph a call: ``x [1, nodes, 4]``,
    ``edge_index [1, 2, edges]``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        h, (src, dst) = self.lin(x[0]), edge_index[0]
        return torch.zeros_like(h).index_add_(0, dst, h[src]).unsqueeze(0)


def build() -> nn.Module:
    return MessagePassing()


def _graphs(count: int, nodes: int, edges: int, seed: int) -> dict[str, torch.Tensor]:
    """``count`` graphs of ``nodes`` nodes and ``edges`` edges; each graph's first edge leaves its last node, so a
    graph cut to fewer nodes keeps an edge to a node cut away."""
    g = torch.Generator().manual_seed(seed)
    edge_index = torch.randint(0, nodes, (count, 2, edges), generator=g)
    edge_index[:, 0, 0] = nodes - 1
    return {"x": torch.randn(count, nodes, 4, generator=g), "edge_index": edge_index}


def graphs() -> DatasetSplits:
    """8 training graphs of 6 nodes / 12 edges, 2 held-out ones of 9 nodes / 18 edges, a class per node."""
    train, val = _graphs(8, 6, 12, 0), _graphs(2, 9, 18, 1)
    labels = lambda n, nodes: torch.randint(0, 3, (n, nodes), generator=torch.Generator().manual_seed(n))  # noqa: E731
    return DatasetSplits(train, labels(8, 6), val, labels(2, 9), num_classes=3)


def _check(tmp_path: Path, shapes: dict[str, list[int]]) -> None:
    """The export's check of the sizes the later stages run, on the graph exported from the held-out graphs."""
    data, model, path = graphs(), MessagePassing().eval(), tmp_path / "m.onnx"
    export_onnx(model, data.val_x, path, dynamic_axes=AXES)
    check_validated_sizes(model, path, ort_session(path), data, ["x", "edge_index"], AXES, shapes, 1e-4, 1e-5)


def test_a_size_cut_from_held_out_graphs_names_the_training_split_and_sizes_without_cutting(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match=r"the model fails at edges=12, nodes=6") as err:
        _check(tmp_path, {})
    hint = err.value.hint or ""
    assert hint.startswith("edges=12, nodes=6 is the training split's rows' size"), hint
    assert "Kiln cut those (their own: edges=18, nodes=9) to it" in hint
    assert "signature.shapes: {edges: [18, 36], nodes: [9, 18]}" in hint
    _check(tmp_path, SUGGESTED)  # the suggested sizes pass


@pytest.mark.slow
def test_a_run_on_graphs_smaller_in_training_fails_with_sizes_that_then_pass(tmp_path: Path) -> None:
    """The whole run: without signature.shapes the export stops with one error:/fix: pair whose suggested sizes,
    given, take the run through validation."""
    cfg = {
        "model": {"name": f"{HERE}:build"},
        "data": {"name": f"{HERE}:graphs"},
        "train": {"epochs": 1, "batch_size": 1, "precision": "fp32"},
        "precision": {"variants": ["fp32"]},
        "build": {"backends": ["onnxruntime"]},
        "signature": {"batch_sizes": [1], "dynamic_axes": AXES},
        "validate": {"warmup": 1, "iterations": 3},
    }
    path = tmp_path / "gnn.yaml"
    path.write_text(yaml.safe_dump(cfg))
    failed = CliRunner().invoke(main, ["run", str(path), "-w", str(tmp_path / "w"), "--until", "export"])
    one_error(failed, "the model fails at edges=12, nodes=6", "signature.shapes: {edges: [18, 36], nodes: [9, 18]}")
    shapes = "signature.shapes={edges: [18, 36], nodes: [9, 18]}"
    passed = CliRunner().invoke(main, ["run", str(path), "-w", str(tmp_path / "w"), "--set", shapes])
    assert passed.exit_code == 0, passed.output
