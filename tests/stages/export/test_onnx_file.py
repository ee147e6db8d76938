"""kiln.stages.export.onnx_file: the user's ``model.onnx`` taken as the export, its axes under the names
``signature.dynamic_axes`` gives them, which the later stages size the engines by."""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import TensorProto, helper

from kiln.core.onnx_io import io_specs
from kiln.stages.export.onnx_file import take_onnx


def _pair(path: Path, mask_axis: str | None = "seq_len") -> Path:
    """``ids [batch, seq_len]`` and ``mask [batch, <mask_axis>]`` -> ``y [batch, seq_len, 4]`` (None: unnamed)."""
    nodes = [
        helper.make_node("Mul", ["ids", "mask"], ["m"]),
        helper.make_node("Unsqueeze", ["m", "axis"], ["u"]),
        helper.make_node("Expand", ["u", "shape"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("ids", TensorProto.FLOAT, ["batch", "seq_len"]),
            helper.make_tensor_value_info("mask", TensorProto.FLOAT, ["batch", mask_axis]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq_len", 4])],
        [
            helper.make_tensor("axis", TensorProto.INT64, [1], [2]),
            helper.make_tensor("shape", TensorProto.INT64, [3], [1, 1, 4]),
        ],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def _shapes(path: Path) -> dict[str, list]:
    inputs, outputs = io_specs(onnx.load(path))
    return {s.name: s.shape for s in [*inputs, *outputs]}


def test_the_copy_takes_the_names_dynamic_axes_gives(tmp_path: Path) -> None:
    """Before: the copy kept the file's 'seq_len' while precision sized 'seq' (the config's name), and the TensorRT
    build refused "dynamic axes ['seq_len'] besides the batch axis, with no sizes known for them", its fix the very
    setting that caused it. Every place of the old name takes the new one; fixed sizes stay."""
    src = _pair(tmp_path / "m.onnx")
    take_onnx(src, tmp_path / "model.onnx", {"ids": {1: "seq"}, "mask": {1: "seq"}})
    assert _shapes(tmp_path / "model.onnx") == {
        "ids": ["batch", "seq"],
        "mask": ["batch", "seq"],
        "y": ["batch", "seq", 4],
    }
    assert _shapes(src)["ids"] == ["batch", "seq_len"]  # the user's file is left as it is


def test_axes_named_apart_or_unnamed_take_one_name(tmp_path: Path) -> None:
    """A file naming the mask's axis apart ('mlen'), or leaving it unnamed, tied by the config's one name."""
    for mask_axis in ("mlen", None):
        src = _pair(tmp_path / f"m_{mask_axis}.onnx", mask_axis)
        take_onnx(src, tmp_path / "model.onnx", {"ids": {1: "seq_len"}, "mask": {1: "seq_len"}})
        shapes = _shapes(tmp_path / "model.onnx")
        assert shapes["mask"] == ["batch", "seq_len"] and shapes["ids"] == ["batch", "seq_len"], mask_axis


def test_without_dynamic_axes_the_files_names_stay(tmp_path: Path) -> None:
    take_onnx(_pair(tmp_path / "m.onnx", "mlen"), tmp_path / "model.onnx")
    assert _shapes(tmp_path / "model.onnx")["mask"] == ["batch", "mlen"]


def test_a_run_from_the_file_exports_its_axes_under_the_configs_names(tmp_path: Path) -> None:
    """``kiln run`` with ``model.onnx`` and ``signature.dynamic_axes`` renaming the file's axes: the export stage's
    copy carries the config's names, which the later stages size the engines by."""
    from click.testing import CliRunner

    from kiln.cli import main

    src = _pair(tmp_path / "m.onnx")
    config = tmp_path / "run.yaml"
    config.write_text(
        f"model: {{onnx: {src}}}\n"
        "signature: {dynamic_axes: {ids: {1: seq}, mask: {1: seq}}, shapes: {seq: [4, 8]}}\n"
    )
    args = ["run", str(config), "-w", str(tmp_path / "w"), "--until", "export", "--quiet"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert _shapes(tmp_path / "w" / "export" / "model.onnx")["ids"] == ["batch", "seq"]
