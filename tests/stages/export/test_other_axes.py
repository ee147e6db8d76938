"""Tying the axes besides the batch that a taken graph's exporter named apart (tf2onnx's ``unk__1`` and ``unk__3``)
where the graph takes them at one size only; axes it runs apart, and names a person gave, stay as they are."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

from kiln.core.data import DatasetSplits
from kiln.pipeline.config import config_from_dict
from kiln.stages.export.other_axes import MAX_NAMES, made_axes, same_size_names, tie_other_axes
from kiln.stages.export.stage import run
from tests.conftest import stage_context


def _saved(tmp_path: Path, nodes: list, inputs: dict[str, str], outputs: dict[str, list[str | int]]) -> Path:
    """A graph of float inputs ``[batch, <name>]`` (``inputs``: input -> its axis 1's name)."""
    ins = [helper.make_tensor_value_info(k, TensorProto.FLOAT, ["batch", n]) for k, n in inputs.items()]
    outs = [helper.make_tensor_value_info(k, TensorProto.FLOAT, dims) for k, dims in outputs.items()]
    model = helper.make_model(helper.make_graph(nodes, "g", ins, outs), opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, tmp_path / "model.onnx")
    return tmp_path / "model.onnx"


def _feed(*names: str, size: int = 6) -> dict[str, np.ndarray]:
    return {n: np.random.default_rng(0).random((2, size), np.float32) for n in names}


def _dims(path: Path) -> dict[str, list[str | int]]:
    graph = onnx.load(path).graph
    return {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in graph.input}


def test_axes_the_graph_adds_are_tied_and_one_it_concatenates_stays_apart(tmp_path: Path) -> None:
    """A BERT's ids and mask (added: one length) beside a tail concatenated after them (a length of its own), all
    named apart as tf2onnx names them: validation fed the ids at one length and the mask at another."""
    nodes = [
        helper.make_node("Add", ["ids", "mask"], ["s"]),
        helper.make_node("Concat", ["s", "tail"], ["out"], axis=1),
    ]
    inputs = {"ids": "unk__1", "mask": "unk__3", "tail": "unk__5"}
    path = _saved(tmp_path, nodes, inputs, {"out": ["batch", "unk__7"]})
    assert tie_other_axes(path, _feed("ids", "mask", "tail")) == {"unk__3": "unk__1"}
    assert _dims(path) == {"ids": ["batch", "unk__1"], "mask": ["batch", "unk__1"], "tail": ["batch", "unk__5"]}


def test_a_short_axis_is_told_apart_by_lengthening_it(tmp_path: Path) -> None:
    """At a fed size of 2 the groups cannot be shortened to 2 or more (size 1 would broadcast): they are lengthened."""
    path = _saved(
        tmp_path, [helper.make_node("Add", ["a", "b"], ["out"])], {"a": "s0", "b": "s1"}, {"out": ["batch", "s0"]}
    )
    assert tie_other_axes(path, _feed("a", "b", size=2)) == {"s1": "s0"}


def test_names_a_person_gave_are_never_renamed(tmp_path: Path) -> None:
    """``seq_a`` and ``seq_b`` are the user's word that the axes are two, however the graph runs."""
    path = _saved(
        tmp_path,
        [helper.make_node("Add", ["a", "b"], ["out"])],
        {"a": "seq_a", "b": "seq_b"},
        {"out": ["batch", "seq_a"]},
    )
    assert tie_other_axes(path, _feed("a", "b")) == {}
    assert _dims(path) == {"a": ["batch", "seq_a"], "b": ["batch", "seq_b"]}


def test_only_names_of_one_size_in_the_data_are_candidates() -> None:
    places = {"unk__1": [("a", 1)], "unk__3": [("b", 1)], "unk__5": [("c", 1)]}
    feed = {"a": np.zeros((2, 6)), "b": np.zeros((2, 6)), "c": np.zeros((2, 4))}
    assert same_size_names(places, feed) == [["unk__1", "unk__3"]]
    many = {f"unk__{i}": [(f"x{i}", 1)] for i in range(MAX_NAMES + 1)}
    assert same_size_names(many, {f"x{i}": np.zeros((2, 6)) for i in range(MAX_NAMES + 1)}) == []


def test_a_name_on_a_first_axis_is_the_batchs() -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["unk__0", "unk__0", "unk__1"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["unk__0", "unk__0", "unk__1"])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x], [y])
    assert made_axes(graph) == {"unk__1": [("x", 2)]}


def test_the_export_stage_ties_a_taken_files_axes_so_validation_feeds_them_alike(tmp_path: Path) -> None:
    """``kiln run`` with a tf2onnx-named ``model.onnx``: the copy the later stages read names the ids' and the mask's
    lengths alike, so validation's shapes (each axis's smallest beside the others' largest) keep them equal."""
    path = _saved(
        tmp_path,
        [helper.make_node("Add", ["ids", "mask"], ["out"])],
        {"ids": "unk__1", "mask": "unk__3"},
        {"out": ["batch", "unk__1"]},
    )
    cfg = config_from_dict({"model": {"onnx": str(path)}, "data": {"name": "mine:load"}})
    x = {"ids": torch.rand(8, 6), "mask": torch.rand(8, 6)}
    (tmp_path / "out").mkdir()
    splits = DatasetSplits(x, None, x, None)
    run(stage_context("export", cfg, tmp_path, tmp_path / "out", {}, load_dataset=lambda: splits))
    assert _dims(tmp_path / "out" / "model.onnx") == {"ids": ["batch", "unk__1"], "mask": ["batch", "unk__1"]}
