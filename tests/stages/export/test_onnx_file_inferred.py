"""A taken ``model.onnx`` that ONNX Runtime runs as given is not broken by ONNX's inferred shapes (which ORT trusts,
and which are wrong for some ops), and a graph that fails in ORT during the output-axis probe is one error."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from kiln.core.errors import ModelError
from kiln.core.onnx_io import ort_run, ort_session
from kiln.stages.export.onnx_file import take_onnx
from kiln.stages.export.output_axes import probe


def _misled(path: Path) -> Path:
    """x [N, 4] -> y [N, 4] through a SequenceAt of a SplitToSequence with a scalar split and keepdims=0: ONNX
    infers it [1, 1], ONNX Runtime computes [1]; with the inferred shape recorded, ORT folds a Shape of it and the
    Concat after fails."""
    nodes = [
        helper.make_node("ReduceSum", ["x", "ax0"], ["r"], keepdims=1),
        helper.make_node("SplitToSequence", ["r", "one"], ["seq"], axis=1, keepdims=0),
        helper.make_node("SequenceAt", ["seq", "zero"], ["a"]),
        helper.make_node("Shape", ["a"], ["s"]),
        helper.make_node("Reshape", ["a", "s"], ["d"]),
        helper.make_node("Concat", ["d", "a"], ["c"], axis=0),
        helper.make_node("ReduceSum", ["c"], ["t"], keepdims=0),
        helper.make_node("Add", ["x", "t"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "misled",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        initializer=[
            helper.make_tensor("zero", TensorProto.INT64, [], [0]),
            helper.make_tensor("one", TensorProto.INT64, [], [1]),
            helper.make_tensor("ax0", TensorProto.INT64, [1], [0]),
        ],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_a_file_that_runs_as_given_is_kept_without_the_inferred_shapes_that_break_it(tmp_path: Path) -> None:
    src, out = _misled(tmp_path / "src.onnx"), tmp_path / "model.onnx"
    feed = {"x": np.random.default_rng(0).random((2, 4), dtype=np.float32)}
    want = ort_run(ort_session(src), feed)[0]
    take_onnx(src, out, feed=feed)
    np.testing.assert_allclose(ort_run(ort_session(out), feed)[0], want, rtol=1e-6)


def test_a_graph_ort_fails_on_in_the_probe_is_one_error(tmp_path: Path) -> None:
    path = _misled(tmp_path / "m.onnx")
    bad = {"x": np.zeros((2, 5), dtype=np.float32)}  # a size the graph refuses
    with pytest.raises(
        ModelError, match=r"m.onnx does not run in ONNX Runtime on the data's first rows \(x \[2, 5\]\)"
    ):
        probe(path, bad, {"x": {0: "N"}})
