"""``calibration.exclude_nodes`` / ``exclude_op_types`` checked against the graph: a name it does not have is an
error with the closest real ones, and an op type that is never quantized is not reported as kept in float."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from kiln.calibration.config import CalibrationConfig
from kiln.calibration.quantize import check_exclusions, excluded_nodes
from kiln.cli import main
from kiln.core.errors import ConfigError
from tests.calibration.calib_graphs import batches, conv_model


def _precision(tmp: Path, *sets: str) -> object:
    model, feed = tmp / "model.onnx", tmp / "x.npz"
    onnx.save(conv_model(), model)
    np.savez(feed, input=np.concatenate(batches()))
    args = ["precision", str(model), "-o", str(tmp / "v"), "--variants", "int8", "--calibration", str(feed)]
    return CliRunner().invoke(main, [*args, *(a for s in sets for a in ("--set", s))])


def test_names_the_graph_does_not_have_are_one_error_with_the_closest(tmp_path: Path) -> None:
    result = _precision(
        tmp_path, "calibration.exclude_nodes=[conv, no_such_node, matmull]", "calibration.exclude_op_types=[Gemmm]"
    )
    assert result.exit_code == 2, result.output
    error, fix = (line for line in result.output.splitlines() if line.startswith(("error:", "fix:")))
    assert "'no_such_node'" in error and "'matmull'" in error and "'Gemmm'" in error and "'conv'" not in error
    assert "'matmull' -> matmul" in fix and "'Gemmm' -> Gemm" in fix
    assert not (tmp_path / "v" / "int8").exists()


def test_an_excluded_op_type_that_is_never_quantized_keeps_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Relu is in the graph but not among op_types: it stays float whatever exclude_op_types says, so the variant
    does not list it as kept in float because of that setting; the setting is said to do nothing."""
    cfg = CalibrationConfig(op_types=["Conv", "MatMul", "Gemm"], exclude_op_types=["Relu", "Gemm"])
    with caplog.at_level(logging.WARNING, logger="kiln.calibration"):
        check_exclusions(conv_model(), cfg)
    assert "Relu not in calibration.op_types" in caplog.text
    assert excluded_nodes(conv_model(), cfg) == ["head"]  # the Gemm; never the Relu
    result = _precision(
        tmp_path, "calibration.op_types=[Conv, MatMul, Gemm]", "calibration.exclude_op_types=[Relu, Gemm]"
    )
    assert result.exit_code == 0, result.output
    int8 = json.loads((tmp_path / "v" / "variants.json").read_text())["variants"]["int8"]
    assert int8["reasons"] == {"head": "Gemm in calibration.exclude_op_types"}


def test_names_the_graph_has_pass() -> None:
    check_exclusions(conv_model(), CalibrationConfig(exclude_nodes=["conv"], exclude_op_types=["MatMul"]))
    with pytest.raises(ConfigError, match="exclude_op_types names op type 'Softmax'"):
        check_exclusions(conv_model(), CalibrationConfig(exclude_op_types=["Softmax"]))
