"""``kiln build FILE``: inputs whose exporter named their first axes apart (tf2onnx's ``unk__42`` and ``unk__43``)
are tied into one batch axis where the graph takes them only in one count, as ``kiln run``'s export ties them, in
Kiln's copy of the file; a true two-tower graph keeps them apart, and the user's file is never changed."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
from onnx import TensorProto, helper

from kiln.core.artifacts import hash_file
from kiln.core.records import EngineMetadata
from kiln.stages.engines.backend import SIDECAR
from kiln.stages.package.triton import served_max_batch
from tests.pipeline.test_faults import invoke


def _tf2onnx_like(path: Path, joined: bool) -> Path:
    """``images [unk__42, 3]`` and ``meta [unk__43, 2]``: joined by a Concat on axis 1 (one output, one count), or
    each to an output of its own (two towers, counts of their own)."""
    value = helper.make_tensor_value_info
    inputs = [value("images", TensorProto.FLOAT, ["unk__42", 3]), value("meta", TensorProto.FLOAT, ["unk__43", 2])]
    if joined:
        nodes = [helper.make_node("Concat", ["images", "meta"], ["out"], axis=1)]
        outputs = [value("out", TensorProto.FLOAT, ["unk__44", 5])]
    else:
        nodes = [helper.make_node("Relu", ["images"], ["a"]), helper.make_node("Relu", ["meta"], ["b"])]
        outputs = [value("a", TensorProto.FLOAT, ["unk__42", 3]), value("b", TensorProto.FLOAT, ["unk__43", 2])]
    model = helper.make_model(
        helper.make_graph(nodes, "g", inputs, outputs), opset_imports=[helper.make_opsetid("", 17)]
    )
    onnx.save(model, path)
    return path


def _built(tmp_path: Path, joined: bool) -> tuple[EngineMetadata, Path, str]:
    """The engine ``kiln build`` makes of the graph, the user's file and its sha256 before the build."""
    src = _tf2onnx_like(tmp_path / "tf.onnx", joined)
    before = hash_file(src)
    result = invoke("build", src, "-o", tmp_path / "engine")
    assert result.exit_code == 0, result.output
    meta = EngineMetadata.model_validate(json.loads((tmp_path / "engine" / SIDECAR).read_text()))
    return meta, src, before


def test_inputs_the_graph_takes_in_one_count_share_one_batch_axis_and_are_served_batched(tmp_path: Path) -> None:
    meta, src, before = _built(tmp_path, joined=True)
    assert [s.shape[0] for s in meta.inputs] == ["unk__42", "unk__42"]
    assert served_max_batch(meta, 32) > 0
    assert hash_file(src) == before  # tied in Kiln's copy, not in the user's file
    assert [d.dim_param for d in (i.type.tensor_type.shape.dim[0] for i in onnx.load(src).graph.input)] == [
        "unk__42",
        "unk__43",
    ]


def test_a_two_tower_graph_keeps_its_inputs_first_axes_apart(tmp_path: Path) -> None:
    meta, src, before = _built(tmp_path, joined=False)
    assert [s.shape[0] for s in meta.inputs] == ["unk__42", "unk__43"]
    assert served_max_batch(meta, 32) == 0 and hash_file(src) == before


def test_a_scalar_input_beside_the_tied_ones_is_one_error(tmp_path: Path) -> None:
    """A scalar ``scale`` beside ``images`` and ``meta``: it has no batch axis for Kiln's checks and servers to slice,
    so the build refuses it with the fix (a batch axis), and leaves no tied copy behind."""
    value = helper.make_tensor_value_info
    inputs = [
        value("images", TensorProto.FLOAT, ["unk__42", 3]),
        value("meta", TensorProto.FLOAT, ["unk__43", 2]),
        value("scale", TensorProto.FLOAT, []),
    ]
    nodes = [
        helper.make_node("Concat", ["images", "meta"], ["c"], axis=1),
        helper.make_node("Mul", ["c", "scale"], ["out"]),
    ]
    graph = helper.make_graph(nodes, "g", inputs, [value("out", TensorProto.FLOAT, ["unk__44", 5])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "s.onnx")
    result = invoke("build", tmp_path / "s.onnx", "-o", tmp_path / "e")
    assert result.exit_code == 2, result.output
    assert "input 'scale' has no axes" in result.output and "scale [batch]" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "e").exists()
    assert not list(tmp_path.glob(".kiln-tied-*"))  # the copy is gone
