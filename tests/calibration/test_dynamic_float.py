"""Dynamic INT8 of a graph whose MatMuls reach their weights through other nodes: nothing is quantized, and the
warning says why (once), with the fix."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
from onnx import helper, numpy_helper

from kiln.calibration.config import CalibrationConfig
from kiln.calibration.quantize import _SAID_FLOAT, quantize_int8_dynamic
from tests.calibration.calib_graphs import save_x_to_y


def transposed_weight(path: Path) -> Path:
    """``x @ W.T``, as exporters write ``nn.Linear`` before constant folding: the MatMul reads a Transpose."""
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32), "w")
    nodes = [helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]), helper.make_node("MatMul", ["x", "wt"], ["y"])]
    return save_x_to_y(path, nodes, [w], ["n", 4])


def test_weights_behind_other_nodes_are_said_once_with_the_fix(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    src = transposed_weight(tmp_path / "m.onnx")
    with caplog.at_level(logging.WARNING):
        for round_ in range(2):  # the precision fallback quantizes the same graph again each round
            info = quantize_int8_dynamic(src, tmp_path / f"q{round_}.onnx", CalibrationConfig())
    assert info["integer_matmuls"] == 0
    said = [r.getMessage() for r in caplog.records if "no MatMul or LSTM was quantized" in r.getMessage()]
    assert len(said) == 1 and "none of its 1 MatMuls takes a stored weight" in said[0]
    assert "`kiln optimize` the graph first" in said[0]


def _said(tmp_path: Path, src: Path, cfg: CalibrationConfig, caplog: pytest.LogCaptureFixture, *exclude: str) -> str:
    """The warning that nothing was quantized, for ``src`` (said once per graph: forgotten first)."""
    _SAID_FLOAT.discard(src)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kiln.calibration"):
        quantize_int8_dynamic(src, tmp_path / "q.onnx", cfg, exclude)
    return next(r.getMessage() for r in caplog.records if "no MatMul or LSTM was quantized" in r.getMessage())


def test_a_graph_whose_compute_is_a_gru_is_not_sent_to_kiln_optimize(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An optimized GRU forecaster has no MatMul at all, and ONNX Runtime has no int8 GRU kernel: the cause is the
    GRU, and folding cannot help."""
    w = numpy_helper.from_array(np.ones((1, 12, 3), np.float32), "w")
    r = numpy_helper.from_array(np.ones((1, 12, 4), np.float32), "r")
    src = save_x_to_y(
        tmp_path / "gru.onnx", [helper.make_node("GRU", ["x", "w", "r"], ["y"], hidden_size=4)], [w, r], [5, "n", 3]
    )
    said = _said(tmp_path, src, CalibrationConfig(), caplog)
    assert "it has no MatMul or Gemm: its compute is in GRU" in said and "kiln optimize" not in said
    assert "drop int8 from precision.variants" in said


def test_an_lstm_kept_in_float_is_said_as_kept(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Dynamic quantization computes an LSTM in int8: one left float was kept so (its op type excluded)."""
    w = numpy_helper.from_array(np.ones((1, 16, 3), np.float32), "w")
    r = numpy_helper.from_array(np.ones((1, 16, 4), np.float32), "r")
    src = save_x_to_y(
        tmp_path / "lstm.onnx", [helper.make_node("LSTM", ["x", "w", "r"], ["y"], hidden_size=4)], [w, r], [5, "n", 3]
    )
    said = _said(tmp_path, src, CalibrationConfig(exclude_op_types=["LSTM"]), caplog)
    assert "it has no MatMul or Gemm: its LSTMs are kept in float" in said and "its compute is in" not in said


def test_a_gemm_the_fallback_kept_is_named_as_kept(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The one Gemm (no MatMul) kept in float by the fallback: said as kept, by name, not as "0 MatMuls"."""
    w = numpy_helper.from_array(np.ones((4, 3), np.float32), "w")
    src = save_x_to_y(tmp_path / "gemm.onnx", [helper.make_node("Gemm", ["x", "w"], ["y"], name="head")], [w], ["n", 4])
    said = _said(tmp_path, src, CalibrationConfig(), caplog, "head")
    assert "its 1 MatMul/Gemm layers with stored weights are all kept in float" in said
    assert "1 by the precision fallback (head)" in said and "0 MatMuls" not in said
    no_gemm = _said(tmp_path, src, CalibrationConfig(op_types=["MatMul"]), caplog)
    assert "1 Gemm, and Gemm is not in calibration.op_types" in no_gemm


def test_matmuls_of_two_activations_are_said_as_such(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    src = save_x_to_y(tmp_path / "qk.onnx", [helper.make_node("MatMul", ["x", "x"], ["y"])], [], [4, 4])
    said = _said(tmp_path, src, CalibrationConfig(), caplog)
    assert "multiply two activations" in said and "kiln optimize" not in said


def test_a_head_kept_by_keep_output_layers_beside_einsum_compute_names_both(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A NODE-style tabular model: its compute in Einsum nodes, its one Gemm the head before a sigmoid, which
    keep_output_layers keeps in float; neither calibration.exclude_* nor the fallback was set."""
    rng = np.random.default_rng(0)
    e = numpy_helper.from_array(rng.standard_normal((4, 8)).astype(np.float32), "e")
    w = numpy_helper.from_array(rng.standard_normal((1, 8)).astype(np.float32), "w")
    nodes = [
        helper.make_node("Einsum", ["x", "e"], ["h"], equation="bi,ij->bj", name="trees"),
        helper.make_node("Gemm", ["h", "w"], ["logit"], transB=1, name="head"),
        helper.make_node("Sigmoid", ["logit"], ["y"], name="proba"),
    ]
    src = save_x_to_y(tmp_path / "node.onnx", nodes, [e, w], ["n", 4])
    said = _said(tmp_path, src, CalibrationConfig(), caplog)
    assert "1 by calibration.keep_output_layers: auto, the last layer before an output (head)" in said, said
    assert "exclude_*" not in said and "fallback" not in said
    assert "the rest of its compute is in 1 Einsum nodes, which dynamic quantization leaves in float" in said
