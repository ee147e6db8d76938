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


class _Scores(torch.nn.Module):
    """Images and texts embedded apart and scored each against each: ``scores [images, texts]`` (CLIP's
    logits_per_image), whose only axis carrying the texts' count is its second."""

    def __init__(self) -> None:
        super().__init__()
        self.img, self.txt = torch.nn.Linear(6, 4), torch.nn.Linear(5, 4)

    def forward(self, tokens: torch.Tensor, pixels: torch.Tensor) -> torch.Tensor:
        return self.img(pixels) @ self.txt(tokens).T


def test_a_score_matrix_keeps_the_texts_and_images_axes_apart(tmp_path: Path, caplog) -> None:
    """A file exported with ``texts`` and ``images`` axes and a ``[images, texts]`` output keeps both names through
    the export stage, silently, and runs 8 texts with 4 images."""
    path = tmp_path / "scores.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(
            _Scores().eval(),
            (torch.rand(3, 5), torch.rand(2, 6)),
            str(path),
            input_names=["tokens", "pixels"],
            output_names=["scores"],
            dynamic_axes={"tokens": {0: "texts"}, "pixels": {0: "images"}, "scores": {0: "images", 1: "texts"}},
            dynamo=False,
        )
    cfg = config_from_dict({"model": {"onnx": str(path)}, "data": {"name": "mine:load"}})
    x = {"tokens": torch.rand(8, 5), "pixels": torch.rand(8, 6)}
    (tmp_path / "out").mkdir()
    ctx = stage_context(
        "export", cfg, tmp_path, tmp_path / "out", {}, load_dataset=lambda: DatasetSplits(x, None, x, None)
    )
    with caplog.at_level("WARNING", logger="kiln.export"):
        run(ctx)
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    inputs, outputs = io_specs(onnx.load(tmp_path / "out" / "model.onnx"))
    assert {s.name: s.shape for s in [*inputs, *outputs]} == {
        "tokens": ["texts", 5],
        "pixels": ["images", 6],
        "scores": ["images", "texts"],
    }
    feed = {"tokens": x["tokens"].numpy(), "pixels": x["pixels"][:4].numpy()}
    assert ort_run(ort_session(tmp_path / "out" / "model.onnx"), feed)[0].shape == (4, 8)


SCORER = """
import torch
from kiln.core.data import DatasetSplits


class Scorer(torch.nn.Module):
    def __init__(self, as_dict: bool = False) -> None:
        super().__init__()
        self.lin, self.as_dict = torch.nn.Linear(5, 3), as_dict

    def forward(self, tokens):
        y = self.lin(tokens)
        return {"scores": y} if self.as_dict else y


def build(as_dict: bool = False):
    return Scorer(as_dict)


def load():
    x = torch.rand(16, 5, generator=torch.Generator().manual_seed(0))
    return DatasetSplits(x[:12], None, x[12:], None)
"""


@pytest.mark.parametrize("as_dict", [False, True])
def test_a_pytorch_model_whose_outputs_the_file_names_otherwise_is_refused_at_export(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, as_dict: bool
) -> None:
    """model.onnx beside model.name: a bare tensor (Kiln names it ``logits``) against the file's ``scores`` fails at
    export with both lists and a fix that works (rename, or return a dict of the file's names), not at validate with
    one to run the export again; a dict with the file's names exports."""
    from tests.pipeline.test_faults import assert_clean, invoke

    (tmp_path / "scorer.py").write_text(SCORER)
    monkeypatch.syspath_prepend(str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(
            torch.nn.Linear(5, 3).eval(),
            (torch.rand(2, 5),),
            str(tmp_path / "scores.onnx"),
            input_names=["tokens"],
            output_names=["scores"],
            dynamic_axes={"tokens": {0: "batch"}, "scores": {0: "batch"}},
            dynamo=False,
        )
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        f"model: {{onnx: {tmp_path / 'scores.onnx'}, name: scorer:build, params: {{as_dict: {str(as_dict).lower()}}}}}"
        "\ndata: {name: scorer:load}\ntrain: {enabled: false}\n"
    )
    out = invoke("run", str(cfg), "-w", str(tmp_path / "wd"), "--until", "export")
    if as_dict:
        assert out.exit_code == 0, out.output
        return
    assert_clean(
        out,
        2,
        "error: model 'scorer:build' returns outputs ['logits'], model.onnx scores.onnx has ['scores']",
        "fix: rename the output 'scores' of scores.onnx to 'logits'",
        "or have forward return a dict with the file's names, {'scores': ...}",
    )
