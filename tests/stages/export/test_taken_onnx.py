"""The export stage taking the user's ``model.onnx``: data whose token ids run past the graph's embedding stop there
with one error naming the split, the input, the value and the table's rows, before any stage runs the data through
ONNX Runtime (whose Gather stops with a traceback naming a node); a two-tower graph keeps the names of its own first
axes on its outputs."""

from __future__ import annotations

import warnings
from pathlib import Path

import onnx
import pytest
import torch

from kiln.core.data import DataContractError, DatasetSplits
from kiln.core.onnx_io import io_specs, ort_run, ort_session
from kiln.pipeline.config import config_from_dict
from kiln.stages.export.stage import run
from tests.conftest import stage_context
from tests.stages.engines.two_tower_engine import OUTPUTS, export_two_towers, two_tower_feed
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


def test_a_two_tower_graph_keeps_the_first_axis_names_of_its_outputs(tmp_path: Path) -> None:
    """Texts and images in counts of their own (``texts``, ``images``, named on the outputs too, beside a dynamic
    ``seq``): the taken graph keeps each output's own first axis, not one batch axis that would tie them, and runs
    5 texts with 2 images."""
    path = export_two_towers(tmp_path / "two_towers.onnx")
    cfg = config_from_dict({"model": {"onnx": str(path)}, "data": {"name": "mine:load"}})
    x = {k: torch.from_numpy(v) for k, v in two_tower_feed(4, 4).items()}
    (tmp_path / "out").mkdir()
    ctx = stage_context(
        "export", cfg, tmp_path, tmp_path / "out", {}, load_dataset=lambda: DatasetSplits(x, None, x, None)
    )
    summary = run(ctx)
    inputs, outputs = io_specs(onnx.load(tmp_path / "out" / "model.onnx"))
    assert {s.name: s.shape for s in [*inputs, *outputs]} == {
        "tokens": ["texts", "seq", 4],
        "pixels": ["images", 6],
        "text_embeds": ["texts", 3],
        "image_embeds": ["images", 3],
    }
    assert summary.output_axes == {}
    answers = ort_run(ort_session(tmp_path / "out" / "model.onnx"), two_tower_feed(5, 2))
    assert {name: a.shape for name, a in zip(OUTPUTS, answers)} == {"text_embeds": (5, 3), "image_embeds": (2, 3)}


class _Joined(torch.nn.Module):
    """Ids and a mask that must come in one count (their product): a BERT's inputs."""

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return (ids.float() * mask.float()).sum(1, keepdim=True)


def test_inputs_an_exporter_named_apart_and_the_graph_takes_in_one_count_get_one_batch_axis(tmp_path: Path) -> None:
    """torch.onnx.export's list form of dynamic_axes names each input's first axis apart (``ids_dynamic_axes_1``,
    ``mask_dynamic_axes_1``): the taken graph refuses 2 ids with 3 masks, so Kiln's copy names them one batch axis
    (served batched); a two-tower graph, which answers texts and images apart, keeps its names (test above)."""
    path = tmp_path / "joined.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(
            _Joined().eval(),
            (torch.ones(2, 4, dtype=torch.int64), torch.ones(2, 4, dtype=torch.int64)),
            str(path),
            input_names=["ids", "mask"],
            output_names=["y"],
            dynamic_axes={"ids": [0], "mask": [0]},
            dynamo=False,
        )
    named = [s.shape[0] for s in io_specs(onnx.load(path))[0]]
    assert len(set(named)) == 2  # as the exporter wrote them
    cfg = config_from_dict({"model": {"onnx": str(path)}, "data": {"name": "mine:load"}})
    x = {"ids": torch.randint(0, 5, (8, 4)), "mask": torch.ones(8, 4, dtype=torch.int64)}
    (tmp_path / "out").mkdir()
    ctx = stage_context(
        "export", cfg, tmp_path, tmp_path / "out", {}, load_dataset=lambda: DatasetSplits(x, None, x, None)
    )
    run(ctx)
    inputs, _ = io_specs(onnx.load(tmp_path / "out" / "model.onnx"))
    assert inputs[0].shape[0] == inputs[1].shape[0] == named[0]
