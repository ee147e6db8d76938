"""The warning on ONNX Runtime CPU INT8 layers left in float for weights behind a Transpose says to `kiln optimize`
only a graph that was not optimized; for one whose optimization rolled passes back it names them."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.stages.optimize.api import OPTIMIZE_RECORD_KEY
from kiln.stages.precision.variants import _say_unfolded

DYNAMIC = {"scheme": "dynamic", "integer_matmuls": 1, "kept_fp32": []}


def _unfolded(record: dict[str, list[str]] | None) -> onnx.ModelProto:
    """x -> MatMul by a transposed stored weight, with the optimizer's ``record`` in its metadata (None: none)."""
    w = numpy_helper.from_array(np.ones((8, 4), np.float32), "w")
    graph = helper.make_graph(
        [
            helper.make_node("Transpose", ["w"], ["wt"], name="transpose_w"),
            helper.make_node("MatMul", ["x", "wt"], ["y"], name="hidden"),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])],
        [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    if record is not None:
        helper.set_model_props(model, {OPTIMIZE_RECORD_KEY: json.dumps(record)})
    return model


def _warning(tmp_path: Path, caplog: pytest.LogCaptureFixture, record: dict[str, list[str]] | None) -> str:
    model = _unfolded(record)
    onnx.save(model, tmp_path / "m.onnx")
    with caplog.at_level(logging.WARNING, logger="kiln.precision"):
        _say_unfolded(model, tmp_path / "m.onnx", DYNAMIC)
    (text,) = [r.getMessage() for r in caplog.records]
    assert "1 of its 1 MatMul/Gemm layers left in float (hidden)" in text
    return text


def test_a_graph_never_optimized_is_told_to_optimize(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert _warning(tmp_path, caplog, None).endswith(
        "`kiln optimize` the graph first, which folds them into stored weights"
    )


def test_a_graph_whose_folding_was_rolled_back_names_the_pass(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    text = _warning(tmp_path, caplog, {"passes": ["fold_constants", "cse"], "rolled_back": ["fold_constants"]})
    assert "rolled back fold_constants on this graph" in text and "`kiln optimize` the graph first" not in text


def test_a_graph_optimized_without_fold_constants_is_told_to_add_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    text = _warning(tmp_path, caplog, {"passes": ["cse"], "rolled_back": []})
    assert text.endswith("add fold_constants, which folds them into stored weights, to optimize.passes")
