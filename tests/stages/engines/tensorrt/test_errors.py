"""TensorRT's ONNX parser errors as Kiln words them: the failing node named even where the parser does not."""

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.core.errors import BuildError
from kiln.stages.engines.tensorrt.errors import parse_onnx

trt = pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX (kiln[rtx]) is not installed")


def scatter_max(path: Path) -> Path:
    """A graph whose ScatterElements takes a reduction (max) TensorRT's importer lacks."""
    data = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6])
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])
    idx = numpy_helper.from_array(np.array([[0, 1, 2, 3, 0, 1]] * 2, dtype=np.int64), "idx")
    base = numpy_helper.from_array(np.zeros((2, 4), dtype=np.float32), "base")
    node = helper.make_node("ScatterElements", ["base", "idx", "x"], ["y"], name="pool_max", axis=1, reduction="max")
    graph = helper.make_graph([node], "g", [data], [out], [idx, base])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    return path


def test_an_error_without_a_node_index_names_the_node_of_its_op(tmp_path: Path) -> None:
    logger = trt.Logger(trt.Logger.INTERNAL_ERROR)
    network = trt.Builder(logger).create_network(0)
    with pytest.raises(BuildError) as err:
        parse_onnx(trt, network, logger, scatter_max(tmp_path / "m.onnx"))
    assert "node 'pool_max' (op ScatterElements)" in str(err.value)
    assert "#-1" not in str(err.value)


def scatter_nd_add(path: Path) -> Path:
    """A graph whose ScatterND sums into its data (``index_add_``: a hand-written GNN's aggregation)."""
    data = helper.make_tensor_value_info("x", TensorProto.FLOAT, [6])
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])
    idx = numpy_helper.from_array(np.array([[0], [1], [2], [3], [0], [1]], dtype=np.int64), "idx")
    base = numpy_helper.from_array(np.zeros(4, dtype=np.float32), "base")
    node = helper.make_node("ScatterND", ["base", "idx", "x"], ["y"], name="aggregate", reduction="add")
    graph = helper.make_graph([node], "g", [data], [out], [idx, base])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    return path


@pytest.mark.parametrize("make", [scatter_max, scatter_nd_add])
def test_a_scatter_with_a_reduction_gets_a_fix_that_can_help(tmp_path: Path, make) -> None:
    logger = trt.Logger(trt.Logger.INTERNAL_ERROR)
    network = trt.Builder(logger).create_network(0)
    with pytest.raises(BuildError) as err:
        parse_onnx(trt, network, logger, make(tmp_path / "m.onnx"))
    hint = err.value.hint or ""
    assert "scatter with a reduction" in hint and "adjacency" in hint and "onnxruntime" in hint
    assert "opset" not in hint
