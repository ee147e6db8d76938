"""The export stage taking the user's ``model.onnx``: data whose token ids run past the graph's embedding stop there
with one error naming the split, the input, the value and the table's rows, before any stage runs the data through
ONNX Runtime (whose Gather stops with a traceback naming a node)."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
import torch

from kiln.core.data import DataContractError, DatasetSplits
from kiln.pipeline.config import config_from_dict
from kiln.stages.export.stage import run
from tests.conftest import stage_context
from tests.stages.precision.precision_graphs import token_graph


def _export(tmp: Path, train_ids: torch.Tensor, val_ids: torch.Tensor) -> object:
    path = tmp / "m.onnx"
    onnx.save(token_graph(vocab=10, length="seq"), path)  # a dynamic axis: the export probes the outputs' axes
    cfg = config_from_dict({"model": {"onnx": str(path)}, "data": {"name": "mine:load"}})
    splits = DatasetSplits(train_ids, None, val_ids, None)
    (tmp / "out").mkdir()
    return run(stage_context("export", cfg, tmp, tmp / "out", {}, load_dataset=lambda: splits))


def test_token_ids_past_the_embedding_are_one_error_naming_the_split(tmp_path: Path) -> None:
    ids = torch.randint(0, 10, (16, 6))
    with pytest.raises(DataContractError) as info:
        _export(tmp_path, ids, ids + 100)
    assert info.value.message == (
        f"the validation data of 'mine:load': input 'input' holds {int(ids.max()) + 100}: m.onnx indexes an axis of "
        "10 positions with it (values 0 to 9, or down to -10 counted from its end)"
    )
    assert info.value.hint.startswith("give indices within what the input indexes")


def test_ids_counted_from_the_end_of_the_table_run_as_onnx_runtime_takes_them(tmp_path: Path) -> None:
    ids = torch.randint(0, 10, (16, 6))
    assert _export(tmp_path, ids - 10, ids).inputs == ["input"]
