"""The precision stage of a run on a graph network in the batch-of-one layout (docs/byom.md: each graph a batch of
one, ``signature.batch_sizes: [1]``): its calibration batches hold one graph each, so INT8 is calibrated on every
training graph, not on the first of one batch of them."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kiln.calibration.feeds import FILE, load_feeds
from kiln.core.data import DatasetSplits
from kiln.pipeline.api import run_pipeline
from kiln.pipeline.config import config_from_dict
from tests.calibration.gnn_graph import gcn_onnx, graphs


def node_graphs() -> DatasetSplits:
    """12 training graphs and 2 held-out ones of 10 nodes, a label per node."""
    train, val = graphs(12, 10, 20), graphs(2, 10, 20, seed=1)
    as_torch = lambda d: {k: torch.from_numpy(v) for k, v in d.items()}  # noqa: E731
    labels = lambda n: torch.from_numpy(np.random.default_rng(n).integers(0, 3, (n, 10)))  # noqa: E731
    return DatasetSplits(as_torch(train), labels(12), as_torch(val), labels(2), num_classes=3)


def test_a_runs_calibration_batches_hold_one_graph_each(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "batch_of_one_data", sys.modules[__name__])
    cfg = config_from_dict(
        {
            "model": {"onnx": str(gcn_onnx(tmp_path / "gcn.onnx"))},
            "data": {"name": "batch_of_one_data:node_graphs"},
            "optimize": {"verify": False},  # its random edge ids would index past the nodes
            "build": {"backends": ["onnxruntime"]},
            "precision": {"variants": ["fp32", "int8"], "node_errors": False},
            "signature": {"batch_sizes": [1], "shapes": {"nodes": [10], "edges": [20]}},
        }
    )
    result, _ = run_pipeline(cfg, tmp_path / "w", stop="precision")
    assert result.error is None, result.error
    saved = load_feeds(tmp_path / "w" / "precision" / FILE, ["x", "edge_index"])
    assert [len(b["x"]) for b in saved] == [1] * 12
    assert sorted(float(b["x"].sum()) for b in saved) == sorted(float(x.sum()) for x in graphs(12, 10, 20)["x"])
