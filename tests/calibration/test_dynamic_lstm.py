"""The ONNX Runtime CPU INT8 graph of a recurrent model: dynamic quantization computes its LSTMs in int8 (ONNX
Runtime's DynamicQuantizeLSTM) beside its linear layers, and leaves a GRU in float (ONNX Runtime has no int8 GRU
kernel); ``auto`` picks that scheme for a recurrent graph without convolutions."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from torch import nn

from kiln.calibration.config import CalibrationConfig
from kiln.calibration.quantize import dynamic_nodes, ort_cpu_scheme, quantize_int8_dynamic
from kiln.core.onnx_io import ort_session
from tests.stages.precision.rnn_graphs import rnn_classifier, rnn_data


def _ops(path: Path) -> list[str]:
    return [n.op_type for n in onnx.load(path).graph.node]


def _cosine(a: Path, b: Path, x: np.ndarray) -> float:
    ref, got = (ort_session(p).run(None, {"x": x})[0].ravel() for p in (a, b))
    return float(ref @ got / np.linalg.norm(ref) / np.linalg.norm(got))


def test_dynamic_int8_computes_an_lstm_classifier_in_int8(tmp_path: Path) -> None:
    src = rnn_classifier(tmp_path / "lstm.onnx", nn.LSTM)
    cfg = CalibrationConfig()
    model = onnx.load(src)
    assert ort_cpu_scheme(model, cfg) == "dynamic"
    assert dynamic_nodes(model, cfg) == {n.name for n in model.graph.node if n.op_type == "LSTM"}
    info = quantize_int8_dynamic(src, tmp_path / "q.onnx", cfg)
    assert info["integer_lstms"] == 2 and _ops(tmp_path / "q.onnx").count("DynamicQuantizeLSTM") == 2
    assert "LSTM" not in _ops(tmp_path / "q.onnx")
    assert _cosine(src, tmp_path / "q.onnx", np.load(rnn_data(tmp_path / "d.npz"))["x"]) > 0.999


def test_an_lstm_excluded_or_kept_by_name_stays_float(tmp_path: Path) -> None:
    src = rnn_classifier(tmp_path / "lstm.onnx", nn.LSTM)
    first = next(n.name for n in onnx.load(src).graph.node if n.op_type == "LSTM")
    excluded = CalibrationConfig(exclude_op_types=["LSTM"])
    assert quantize_int8_dynamic(src, tmp_path / "none.onnx", excluded)["integer_lstms"] == 0
    assert dynamic_nodes(onnx.load(src), excluded) == set()
    assert quantize_int8_dynamic(src, tmp_path / "one.onnx", CalibrationConfig(), [first])["integer_lstms"] == 1


def test_a_gru_stays_float_beside_its_int8_head(tmp_path: Path) -> None:
    src = rnn_classifier(tmp_path / "gru.onnx", nn.GRU)
    info = quantize_int8_dynamic(src, tmp_path / "q.onnx", CalibrationConfig())
    ops = _ops(tmp_path / "q.onnx")
    assert info["integer_lstms"] == 0 and ops.count("GRU") == 2 and "MatMulInteger" in ops
    assert dynamic_nodes(onnx.load(src), CalibrationConfig()) == set()
