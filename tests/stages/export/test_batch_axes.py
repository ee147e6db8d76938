"""Tying the first axes of a taken graph's inputs that its exporter named apart: by running the graph, the finest
grouping of inputs it takes in counts of their own, whatever the inputs' order; an input it never reads joins."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kiln.stages.export.batch_axes import first_axis_names, partitions, tie_batch_axes

W = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")


def _saved(tmp_path: Path, nodes: list, inputs: list[tuple[str, str | None]], outputs: list[tuple[str, str]]) -> Path:
    def value(name: str, first: str | None) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, [first, 4])

    graph = helper.make_graph(nodes, "g", [value(*i) for i in inputs], [value(*o) for o in outputs], [W])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, tmp_path / "model.onnx")
    return tmp_path / "model.onnx"


def _feed(*names: str) -> dict[str, np.ndarray]:
    return {n: np.random.default_rng(0).random((2, 4), np.float32) for n in names}


def test_a_tower_listed_first_keeps_its_count_and_the_other_towers_inputs_are_tied(tmp_path: Path) -> None:
    """Images first, then ids and a mask that must come in one count: ids and mask tied, images apart (checking
    each input against the first alone tied all three)."""
    nodes = [
        helper.make_node("MatMul", ["pixel", "w"], ["img_emb"]),
        helper.make_node("Mul", ["ids", "mask"], ["t"]),
        helper.make_node("MatMul", ["t", "w"], ["txt_emb"]),
    ]
    inputs = [("pixel", "img_n"), ("ids", "ids_n"), ("mask", "mask_n")]
    path = _saved(tmp_path, nodes, inputs, [("img_emb", "img_n"), ("txt_emb", "ids_n")])
    assert tie_batch_axes(path, _feed("pixel", "ids", "mask")) == {"mask_n": "ids_n"}
    assert first_axis_names(onnx.load(path).graph) == {"pixel": "img_n", "ids": "ids_n", "mask": "ids_n"}


def test_an_input_the_graph_never_reads_and_an_unnamed_first_axis_join_the_batch(tmp_path: Path) -> None:
    """A DistilBERT's token_type_ids, named apart and never read, would keep a count of its own and leave the engine
    unbatched; an input whose dynamic first axis has no name is tied by its own place."""
    nodes = [helper.make_node("Mul", ["ids", "mask"], ["t"]), helper.make_node("MatMul", ["t", "w"], ["out"])]
    path = _saved(tmp_path, nodes, [("ids", "ids_n"), ("mask", None), ("tt", "tt_n")], [("out", "ids_n")])
    assert tie_batch_axes(path, _feed("ids", "mask", "tt")) == {"<mask>": "ids_n", "tt_n": "ids_n"}
    assert set(first_axis_names(onnx.load(path).graph).values()) == {"ids_n"}


def test_groupings_come_finest_first() -> None:
    found = list(partitions(["a", "b", "c"]))
    assert found[0] == [["a"], ["b"], ["c"]] and found[-1] == [["a", "b", "c"]] and len(found) == 5


def test_a_mask_the_graph_takes_in_any_count_but_no_output_follows_joins_the_batch(tmp_path: Path) -> None:
    """A legacy torch.onnx.export of a DistilBERT (list-form dynamic_axes: ids and mask named apart) runs with 2 ids
    and 3 masks, so running alone could not tie them and the engine was served unbatched; its outputs follow the
    ids' count alone, so the mask joins their batch."""
    nodes = [
        helper.make_node("ReduceSum", ["mask"], ["total"], keepdims=0),  # every row of the mask, whatever its count
        helper.make_node("Add", ["ids", "total"], ["shifted"]),
        helper.make_node("MatMul", ["shifted", "w"], ["out"]),
    ]
    path = _saved(tmp_path, nodes, [("ids", "ids_n"), ("mask", "mask_n")], [("out", "ids_n")])
    assert tie_batch_axes(path, _feed("ids", "mask")) == {"mask_n": "ids_n"}


def _scores_graph(tmp_path: Path, classes: int = 4) -> Path:
    """Images and texts embedded apart and scored each against each: ``scores [images, texts]`` carries the texts'
    count at axis 1 only (CLIP's logits_per_image)."""
    w = numpy_helper.from_array(np.ones((4, classes), np.float32), "w")
    nodes = [
        helper.make_node("MatMul", ["pixel", "w"], ["img_emb"]),
        helper.make_node("MatMul", ["ids", "w"], ["txt_emb"]),
        helper.make_node("Transpose", ["txt_emb"], ["txt_t"], perm=[1, 0]),
        helper.make_node("MatMul", ["img_emb", "txt_t"], ["scores"]),
    ]
    value = lambda name, dims: helper.make_tensor_value_info(name, TensorProto.FLOAT, dims)  # noqa: E731
    inputs = [value("ids", ["texts", 4]), value("pixel", ["images", 4])]
    graph = helper.make_graph(nodes, "g", inputs, [value("scores", ["images", "texts"])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, tmp_path / "model.onnx")
    return tmp_path / "model.onnx"


def test_an_input_whose_count_an_output_carries_past_its_first_axis_keeps_its_name(tmp_path: Path) -> None:
    """A score matrix [images, texts] follows the texts' count at axis 1: texts stay apart from images."""
    path = _scores_graph(tmp_path)
    assert tie_batch_axes(path, _feed("ids", "pixel")) == {}
    assert first_axis_names(onnx.load(path).graph) == {"ids": "texts", "pixel": "images"}


def test_a_fixed_output_size_equal_to_a_masks_count_does_not_keep_the_mask_apart(tmp_path: Path, caplog) -> None:
    """A legacy mask beside 3 classes: the mask's count (3 in the first run) equals a fixed size of the output,
    which a second run at other counts tells apart; the tie is a warning naming why."""
    w3 = numpy_helper.from_array(np.ones((4, 3), np.float32), "w")
    nodes = [
        helper.make_node("ReduceSum", ["mask"], ["total"], keepdims=0),
        helper.make_node("Add", ["ids", "total"], ["shifted"]),
        helper.make_node("MatMul", ["shifted", "w"], ["out"]),
    ]
    value = lambda name, dims: helper.make_tensor_value_info(name, TensorProto.FLOAT, dims)  # noqa: E731
    inputs = [value("ids", ["ids_n", 4]), value("mask", ["mask_n", 4])]
    graph = helper.make_graph(nodes, "g", inputs, [value("out", ["ids_n", 3])], [w3])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, tmp_path / "model.onnx")
    with caplog.at_level("WARNING", logger="kiln.export"):
        assert tie_batch_axes(tmp_path / "model.onnx", _feed("ids", "mask")) == {"mask_n": "ids_n"}
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(said) == 1 and "'mask_n' is now 'ids_n' (no output has an axis that follows the count" in said[0]


def test_inputs_the_graph_runs_in_one_count_only_are_tied_quietly_saying_so(tmp_path: Path, caplog) -> None:
    """An exporter's per-input names (torch.onnx.export's ``input_ids_dynamic_axes_1``) on inputs the graph runs in
    one count only: the tie is certain, said at INFO, not a warning on every such export."""
    nodes = [helper.make_node("Mul", ["ids", "mask"], ["t"]), helper.make_node("MatMul", ["t", "w"], ["out"])]
    path = _saved(tmp_path, nodes, [("ids", "ids_n"), ("mask", "mask_n")], [("out", "ids_n")])
    with caplog.at_level("INFO", logger="kiln.export"):
        assert tie_batch_axes(path, _feed("ids", "mask")) == {"mask_n": "ids_n"}
    said = [r.getMessage() for r in caplog.records if r.name == "kiln.export"]
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(said) == 1 and "'mask_n' is now 'ids_n' (the graph runs them only in one count)" in said[0]


def test_a_group_whose_first_input_has_an_unnamed_first_axis_gets_its_name_on_every_input(tmp_path: Path) -> None:
    """Both first axes unnamed (an exporter's ``None``): the tie names the first input's axis too, so the inputs
    share one name rather than one unnamed axis beside a named one."""
    nodes = [helper.make_node("Mul", ["ids", "mask"], ["t"]), helper.make_node("MatMul", ["t", "w"], ["out"])]
    path = _saved(tmp_path, nodes, [("ids", None), ("mask", None)], [("out", "n")])
    assert tie_batch_axes(path, _feed("ids", "mask")) == {"<mask>": "<ids>"}
    dims = [i.type.tensor_type.shape.dim[0] for i in onnx.load(path).graph.input]
    assert [d.dim_param for d in dims] == ["<ids>", "<ids>"]
