"""The data's float ranges are recorded beside an engine, not built into it: an engine kept across new data gets the
new ranges in its kiln-engine.json, with no rebuild."""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import TensorProto, helper

from kiln.stages.engines import stage
from kiln.stages.engines.backend import SIDECAR, read_metadata


def _graph(path: Path) -> Path:
    node = helper.make_node("Relu", ["x"], ["y"])
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", 4]) for n in ("x", "y")]
    onnx.save(helper.make_model(helper.make_graph([node], "g", io[:1], io[1:])), path)
    return path


def test_a_kept_engine_records_the_datas_new_ranges(tmp_path: Path) -> None:
    src = _graph(tmp_path / "m.onnx")
    out = tmp_path / "e"
    args = (src, out, "onnxruntime", "cpu", "fp32", stage.BuildConfig(), tmp_path / "cache")
    meta = stage.build_engine(*args, value_ranges={"x": [0.0, 1.0], "other": [5.0, 6.0]})
    assert meta.value_ranges == {"x": [0.0, 1.0]} and read_metadata(out).value_ranges == {"x": [0.0, 1.0]}
    before = (out / SIDECAR).stat().st_mtime_ns
    stage._record_ranges(out, {"x": [0.0, 1.0]})  # unchanged: not rewritten
    assert (out / SIDECAR).stat().st_mtime_ns == before
    stage._record_ranges(out, {"x": [-1.0, 2.0]})
    assert read_metadata(out).value_ranges == {"x": [-1.0, 2.0]}
