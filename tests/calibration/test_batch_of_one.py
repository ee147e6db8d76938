"""Calibration batches of a model that reads fewer rows a call than it is fed (a graph network in the batch-of-one
layout: ``signature.batch_sizes: [1]``, a graph that reads row 0 only): as many rows as configured, in batches no
larger than one call reads, so no row goes unread."""

from __future__ import annotations

import logging
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from kiln.calibration.config import CalibrationConfig
from kiln.calibration.data import batch_limit, calibration_batches
from kiln.core.data import DatasetSplits
from kiln.core.feeds import rows_per_call
from kiln.core.onnx_io import io_specs, load_onnx
from tests.calibration.calib_graphs import conv_model
from tests.calibration.gnn_graph import gcn_onnx, graphs


def _gnn_data(count: int = 12) -> DatasetSplits:
    train, val = graphs(count, 10, 20), graphs(2, 10, 20, seed=1)
    as_torch = lambda d: {k: torch.from_numpy(v) for k, v in d.items()}  # noqa: E731
    return DatasetSplits(as_torch(train), torch.zeros(count, 10).long(), as_torch(val), torch.zeros(2, 10).long(), 3)


def test_the_graphs_rows_a_call_are_read_off_its_outputs(tmp_path: Path) -> None:
    """Inputs of a symbolic batch and an output whose axis 0 is a fixed 1: one row a call; a CNN answers every row."""
    gcn = io_specs(load_onnx(gcn_onnx(tmp_path / "gcn.onnx")))
    assert rows_per_call(*gcn) == 1
    assert batch_limit([1, 32], *gcn)[0] == 1
    assert rows_per_call(*io_specs(conv_model())) is None
    assert batch_limit([1, 8], *io_specs(conv_model())) == (8, "the largest of signature.batch_sizes [1, 8]")


def test_dataset_batches_of_a_batch_of_one_model_hold_one_graph_each(caplog: pytest.LogCaptureFixture) -> None:
    """calibration.batch_size 32 put the 12 training graphs in one batch, of which the model read graph 0 only."""
    data, cfg = _gnn_data(), CalibrationConfig()
    with caplog.at_level(logging.INFO, logger="kiln.calibration"):
        batches = calibration_batches(data, cfg, 0, ["x", "edge_index"], limit=batch_limit([1]))
    assert len(batches) == 12 and all(len(b["x"]) == 1 for b in batches if isinstance(b, dict))
    seen = {float(b["x"].sum()) for b in batches if isinstance(b, dict)}
    assert seen == {float(x.sum()) for x in data.train_x["x"].numpy()}  # every graph, once
    said = [r.getMessage() for r in caplog.records if "batches of at most" in r.getMessage()]
    assert said == [
        "calibration: 12 rows in 12 batches of at most 1 row (the largest of signature.batch_sizes [1]), not 1 batch"
    ]


def test_a_readers_batches_are_split_to_the_rows_a_call_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader yielding 6 graphs a batch: each graph in a batch of its own, in order."""
    module = types.ModuleType("gnn_reader")
    module.read = lambda: iter([graphs(6, 10, 20, seed=s) for s in range(2)])  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "gnn_reader", module)
    specs = io_specs(load_onnx(gcn_onnx(tmp_path / "gcn.onnx")))
    cfg = CalibrationConfig(reader="gnn_reader:read")
    batches = calibration_batches(_gnn_data(), cfg, inputs=specs[0], limit=batch_limit([1, 32], *specs))
    assert [len(b["x"]) for b in batches if isinstance(b, dict)] == [1] * 12
    first = graphs(6, 10, 20, seed=0)["x"]
    assert all(np.array_equal(b["x"][0], x) for b, x in zip(batches, first) if isinstance(b, dict))
