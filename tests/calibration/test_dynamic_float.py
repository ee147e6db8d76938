"""Dynamic INT8 of a graph whose MatMuls reach their weights through other nodes: nothing is quantized, and the
warning says why (once), with the fix."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.calibration.config import CalibrationConfig
from kiln.calibration.quantize import quantize_int8_dynamic


def transposed_weight(path: Path) -> Path:
    """``x @ W.T``, as exporters write ``nn.Linear`` before constant folding: the MatMul reads a Transpose."""
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32), "w")
    nodes = [helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]), helper.make_node("MatMul", ["x", "wt"], ["y"])]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3])],
        [w],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_weights_behind_other_nodes_are_said_once_with_the_fix(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    src = transposed_weight(tmp_path / "m.onnx")
    with caplog.at_level(logging.WARNING):
        for round_ in range(2):  # the precision fallback quantizes the same graph again each round
            info = quantize_int8_dynamic(src, tmp_path / f"q{round_}.onnx", CalibrationConfig())
    assert info["integer_matmuls"] == 0
    said = [r.getMessage() for r in caplog.records if "no MatMul was quantized" in r.getMessage()]
    assert len(said) == 1 and "none of its 1 MatMuls takes a stored weight" in said[0]
    assert "`kiln optimize` the graph first" in said[0]
