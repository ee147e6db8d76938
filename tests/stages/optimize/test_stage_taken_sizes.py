"""The optimize stage after a taken ``model.onnx``: the export stage records the data's sizes of the file's dynamic
axes (``dynamic_sizes.json``), so the safety net runs the input model at them. A decoder step whose mask is one
column longer than its cache (``total = past + 1``) runs at the data's sizes only, not at one size for every axis."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

from kiln.core.data import DatasetSplits
from kiln.pipeline.config import config_from_dict
from kiln.stages.export.declaration import read_dynamic_sizes
from kiln.stages.export.stage import run as export
from kiln.stages.optimize.stage import run as optimize
from tests.conftest import stage_context


def _step_graph(path: Path) -> Path:
    """past [B, past] and new [B, 1] concatenated, added to total [B, total]: total must be past + 1."""
    graph = helper.make_graph(
        [
            helper.make_node("Concat", ["past", "new"], ["cat"], axis=1),
            helper.make_node("Add", ["cat", "total"], ["out"]),
        ],
        "step",
        [
            helper.make_tensor_value_info("past", TensorProto.FLOAT, ["B", "past"]),
            helper.make_tensor_value_info("new", TensorProto.FLOAT, ["B", 1]),
            helper.make_tensor_value_info("total", TensorProto.FLOAT, ["B", "total"]),
        ],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["B", "total"])],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def _rows(n: int) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(n)
    shapes = {"past": (n, 7), "new": (n, 1), "total": (n, 8)}
    return {k: torch.from_numpy(rng.random(s, dtype=np.float32)) for k, s in shapes.items()}


def test_the_safety_net_runs_a_taken_decoder_step_at_the_datas_sizes(tmp_path: Path) -> None:
    cfg = config_from_dict({"model": {"onnx": str(_step_graph(tmp_path / "m.onnx"))}, "data": {"name": "mine:load"}})
    splits = DatasetSplits(_rows(16), None, _rows(8), None)
    (tmp_path / "export").mkdir()
    (tmp_path / "optimize").mkdir()
    export(stage_context("export", cfg, tmp_path, tmp_path / "export", {}, load_dataset=lambda: splits))
    assert read_dynamic_sizes(tmp_path / "export") == {"past": {1: [7, 7]}, "total": {1: [8, 8]}}
    inputs = {"export": tmp_path / "export"}
    summary = optimize(stage_context("optimize", cfg, tmp_path, tmp_path / "optimize", inputs))
    assert (tmp_path / "optimize" / "model.onnx").is_file() and summary.nodes_after >= 1
