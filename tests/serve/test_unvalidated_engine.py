"""``kiln serve`` of an engine no validation has seen (``kiln build``'s own folder): the warning says the sizes the
server will take, those the engine records, and does not claim it takes any size its axes do."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from kiln.serve.server import find_engines
from kiln.stages.engines.config import BuildConfig
from kiln.stages.engines.stage import build_direct


def _engine(tmp: Path, sizes: dict[str, list[int]] | None) -> Path:
    """A Relu over ``x [batch, seq]`` built by ``kiln build`` directly, recording ``sizes``."""
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "seq",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq"])],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), tmp / "m.onnx")
    build_direct(tmp / "m.onnx", tmp / "e", "onnxruntime", "cpu", None, BuildConfig(), sizes)
    return tmp / "e"


def _warning(path: Path, caplog: pytest.LogCaptureFixture) -> str:
    caplog.clear()
    with caplog.at_level("WARNING", logger="kiln"):
        find_engines(path)
    said = [r.getMessage() for r in caplog.records if "has no validation record" in r.getMessage()]
    assert len(said) == 1, said
    return said[0]


def test_the_warning_names_the_sizes_the_engine_records(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    said = _warning(_engine(tmp_path, {"seq": [16]}), caplog)
    assert "only at the sizes it records, those it was built for (seq from 16 to 16)" in said, said
    assert "any size" not in said, said


def test_an_engine_recording_no_sizes_is_said_to_take_any(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    said = _warning(_engine(tmp_path, None), caplog)
    assert "at any size its axes take" in said, said
