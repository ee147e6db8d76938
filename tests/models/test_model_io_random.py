"""The warning of a run from model.onnx without data.name: its validation is on random inputs, its calibration only
where no calibration.reader gives real batches (a reader's batches are what the precision stage calibrates on)."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.core.signature import Signature
from kiln.models.config import DataConfig, ModelConfig
from kiln.models.model_io import dataset_for


def _matmul(path: Path) -> Path:
    """``x [batch, 4]`` -> MatMul -> ``y [batch, 3]``."""
    w = numpy_helper.from_array(np.ones((4, 3), np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "mm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
        [w],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_the_random_inputs_warning_leaves_calibration_to_a_reader(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = ModelConfig(onnx=str(_matmul(tmp_path / "model2.onnx")))
    with caplog.at_level(logging.WARNING):
        data = dataset_for(model, DataConfig(), Signature(), seed=0)
    assert data.val_y is None and data.name == "random inputs of model2.onnx"
    said = " ".join(r.getMessage() for r in caplog.records if "RANDOM" in r.getMessage())
    assert "validating on RANDOM inputs, and calibrating on them unless calibration.reader is set" in said, said
    assert "calibrating and validating on RANDOM inputs" not in said
