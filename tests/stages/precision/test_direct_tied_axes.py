"""`kiln precision model.onnx --calibration data.npz` whose arrays differ on an axis the graph names alike: one
error/fix pair naming the inputs, the axis and both sizes, before calibration runs the data through ONNX Runtime
(whose broadcast stops with a traceback)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from tests.pipeline.test_faults import assert_clean, invoke


def _tied_graph(path: Path) -> Path:
    """ids [batch, qlen] float and mask [batch, qlen] float -> Mul -> MatMul over qlen -> out [batch, 2]."""
    w = onnx.numpy_helper.from_array(np.ones((1, 2), np.float32), "w")
    axes = onnx.numpy_helper.from_array(np.array([1], np.int64), "axes")
    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["ids", "mask"], ["m"]),
            helper.make_node("ReduceSum", ["m", "axes"], ["s"], keepdims=1),
            helper.make_node("MatMul", ["s", "w"], ["out"]),
        ],
        "tied",
        [
            helper.make_tensor_value_info("ids", TensorProto.FLOAT, ["batch", "qlen"]),
            helper.make_tensor_value_info("mask", TensorProto.FLOAT, ["batch", "qlen"]),
        ],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", 2])],
        [w, axes],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), path)
    return path


def _run(tmp: Path, mask_len: int) -> object:
    model, feed = _tied_graph(tmp / "m.onnx"), tmp / "d.npz"
    rng = np.random.default_rng(0)
    np.savez(feed, ids=rng.random((32, 8), np.float32), mask=rng.random((32, mask_len), np.float32))
    return invoke("precision", model, "-o", tmp / "v", "--variants", "int8", "--calibration", feed)


def test_calibration_arrays_that_differ_on_a_shared_axis_are_one_error_naming_them(tmp_path: Path) -> None:
    result = _run(tmp_path, 6)
    assert_clean(result, 2, "inputs 'ids' and 'mask' differ on axis qlen (8 against 6)", "fix: give every array")
    assert not (tmp_path / "v" / "int8").exists()


def test_calibration_arrays_at_one_size_on_a_shared_axis_calibrate(tmp_path: Path) -> None:
    result = _run(tmp_path, 8)
    assert result.exit_code == 0, result.output
    assert (tmp_path / "v" / "int8" / "model.onnx").is_file()
