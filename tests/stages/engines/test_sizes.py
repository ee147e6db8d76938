"""What ``kiln build FILE`` says of dynamic axes it cannot size: an axis with no name in the graph (``?``) is named
``input[axis]``, and the fix it gives (name it in the file, then size it) applies."""

from __future__ import annotations

import logging
import re
import shlex
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from kiln.pipeline.config import set_value
from kiln.stages.engines.sizes import checked_ranges


def _graph(path: Path, dims: list[str | int | None]) -> Path:
    """``out = a + b`` over two float inputs of ``dims`` (None: a dim with neither a name nor a size)."""
    ins = [helper.make_tensor_value_info(k, TensorProto.FLOAT, dims) for k in ("a", "b")]
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, dims)
    graph = helper.make_graph([helper.make_node("Add", ["a", "b"], ["out"])], "g", ins, [out])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_unnamed_axes_are_named_by_place_and_the_fix_applies(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The warning read ``axes : ...`` with the fix ``--set 'signature.shapes={}'``, which sizes nothing."""
    src = _graph(tmp_path / "m.onnx", [None, None])
    with caplog.at_level(logging.WARNING, logger="kiln.build"):
        assert checked_ranges([src], {}) == ({}, {})
    [said] = _warnings(caplog)
    assert said.startswith("axes a[1], b[1] have no name in the graph"), said
    command = re.search(r'python -c "(.*?)"', said)
    flag = re.search(r"with (--set '.*?')", said)
    assert command is not None and flag is not None
    exec(command.group(1), {})  # the user's step: name the axes in a copy of the file
    key, _, text = shlex.split(flag.group(1))[1].partition("=")
    shapes = {k: [2, 5] for k in set_value(key, text)}  # the flag as the CLI reads it, MIN and MAX filled in
    assert shapes == {"a_1": [2, 5], "b_1": [2, 5]}
    ranges, _ = checked_ranges([tmp_path / "m.named.onnx"], shapes)
    assert ranges == shapes


def test_a_graph_with_no_axes_to_size_says_nothing_of_them(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A graph ONNX Runtime cannot run here, with no dynamic axis besides the batch: no ``axes :`` warning (the
    build's own error says why it cannot run)."""
    src = _graph(tmp_path / "m.onnx", ["batch", 4])
    model = onnx.load(src)
    model.ir_version = 99  # one this ONNX Runtime cannot load
    onnx.save(model, src)
    with caplog.at_level(logging.WARNING, logger="kiln.build"):
        assert checked_ranges([src], {}) == ({}, {})
    assert _warnings(caplog) == []


def test_a_size_the_graph_refuses_is_said_by_onnx_runtimes_reason_not_its_source_place(tmp_path: Path) -> None:
    """ORT's message starts with the C++ file, line and signature where it failed, which the length limit let take
    the place of its reason."""
    from kiln.stages.engines.sizes import SizeProbe

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "n"])
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, [4])
    shape = helper.make_tensor("shape", TensorProto.INT64, [1], [4])
    graph = helper.make_graph([helper.make_node("Reshape", ["x", "shape"], ["out"])], "g", [x], [out], [shape])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, tmp_path / "m.onnx")
    probe = SizeProbe(tmp_path / "m.onnx")
    assert probe.fails({"n": 4}) is None
    why = probe.fails({"n": 3})
    assert why and "cannot be reshaped" in why and not re.search(r"\.(h|cc):\d+", why), why
