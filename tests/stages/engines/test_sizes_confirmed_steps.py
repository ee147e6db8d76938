"""The steps `kiln build FILE` records between the ends of a range come from a period seen repeat, not from two sizes:
a graph that runs at 32 and 64 alone records those two sizes (an engine then says "at sizes 32, 64"), while one that
runs at every multiple of 32 records steps of 32, confirmed past the range. Steps an export wrote into the file merge
with the build's, listed sizes included."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln import load_engine
from kiln.core.errors import InputError
from kiln.core.records import takes_size
from kiln.stages.engines.config import BuildConfig
from kiln.stages.engines.sizes import merged_steps
from kiln.stages.engines.stage import build_direct
from kiln.stages.export.declaration import GRAPH_STEPS_KEY

# steps that list their sizes: a period past any size, each residue a size itself
LISTED = 65536


def _rows_graph(path: Path, rows: int | None) -> Path:
    """``a[batch, n]`` reshaped into rows of 32 (n a multiple of 32), plus a [rows, 32] table where ``rows`` is given:
    then n / 32 must be 1 or ``rows`` (broadcasting), which leaves 32 and 32 * rows alone."""
    shape = numpy_helper.from_array(np.array([0, -1, 32], np.int64), "shape")
    nodes = [helper.make_node("Constant", [], ["shape"], value=shape)]
    nodes.append(helper.make_node("Reshape", ["a", "shape"], ["r" if rows else "y"]))
    if rows:
        table = numpy_helper.from_array(np.ones((rows, 32), np.float32), "table")
        nodes += [
            helper.make_node("Constant", [], ["table"], value=table),
            helper.make_node("Add", ["r", "table"], ["y"]),
        ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["batch", "n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def _build(src: Path, sizes: dict[str, list[int]]) -> object:
    return build_direct(src, src.parent / "engine", "onnxruntime", "cpu", None, BuildConfig(), sizes)


def test_two_sizes_alone_record_those_sizes_not_a_period_made_of_them(tmp_path: Path) -> None:
    """The graph runs at 32 and 64 and not at 96: no period of 32 is recorded from the two, the sizes are, and the
    engine's refusal says them. A graph that runs at every multiple of 32 gets its steps, confirmed at 96."""
    meta = _build(_rows_graph(tmp_path / "two.onnx", rows=2), {"n": [32, 64]})
    assert meta.axis_steps == {"n": [LISTED, 32, 64]}
    with load_engine(tmp_path / "engine") as engine:
        with pytest.raises(
            InputError, match=r"\(n\) is 48: .* graph takes n only at sizes 32, 64 .* nearest sizes .* 32 and 64"
        ):
            engine.infer({"a": np.zeros((1, 48), np.float32)})
        engine.infer({"a": np.zeros((1, 64), np.float32)})
    assert _build(_rows_graph(tmp_path / "rows.onnx", rows=None), {"n": [32, 64]}).axis_steps == {"n": [32, 0]}


def test_sizes_an_export_listed_merge_with_the_builds_steps_and_are_said_as_sizes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The export found its graph right at 64 and 96 alone (listed); the build's probe finds steps of 32: the engine
    takes 64 and 96 only, and the warning about 128, given but off them, says the sizes, not residues of 65536."""
    src = _rows_graph(tmp_path / "rows.onnx", rows=None)
    model = onnx.load(str(src))
    helper.set_model_props(model, {GRAPH_STEPS_KEY: json.dumps({"n": [LISTED, 64, 96]})})
    onnx.save(model, str(src))
    with caplog.at_level(logging.WARNING, logger="kiln.build"):
        meta = _build(src, {"n": [64, 128]})
    assert meta.axis_steps == {"n": [LISTED, 64, 96]}
    assert "gives n=128, where the graph of rows.onnx does not compute the model (its export recorded n at sizes " in (
        caplog.text
    )
    assert "recorded n at sizes 64, 96 only)" in caplog.text


def test_listed_sizes_merge_with_any_period_into_the_listed_sizes_it_takes() -> None:
    """Sizes listed (``[65536, 64, 96]``) merged with steps of 3, no divisor of 65536, keep 96 alone, listed: the
    listed period is no step, so no multiple of it (131136) may come in; and a listed pattern takes its sizes only,
    not one a listed period past them."""
    assert merged_steps([3, 0], [LISTED, 64, 96]) == [LISTED, 96]
    assert merged_steps([LISTED, 64, 96], [3, 0]) == [LISTED, 96]
    assert merged_steps([LISTED, 64, 96], [LISTED, 96, 128]) == [LISTED, 96]
    assert merged_steps([32, 0], [LISTED, 64, 96]) == [LISTED, 64, 96]
    assert not takes_size([LISTED, 64, 96], 64 + LISTED)
    assert takes_size([LISTED, 64, 96], 96) and not takes_size([LISTED, 64, 96], 80)
