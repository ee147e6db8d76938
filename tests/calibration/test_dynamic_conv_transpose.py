"""Dynamic INT8 of a graph whose compute is in ConvTranspose layers: nothing is quantized, and the warning does not
send the user to the static scheme, which ONNX Runtime's CPU provider runs in float for ConvTranspose too; a graph
with Conv layers is sent there, naming the kernel static computes them in."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
from onnx import helper, numpy_helper

from kiln.calibration.config import CalibrationConfig
from kiln.calibration.quantize import _SAID_FLOAT, quantize_int8_dynamic
from tests.calibration.calib_graphs import save_x_to_y


def _graph(path: Path, *ops: str) -> Path:
    """x [n, 4, 4, 4] through one 4-channel layer per op of ``ops`` (ConvTranspose: 2x2, stride 2; Conv: 3x3)."""
    nodes, inits, last = [], [], "x"
    for i, op in enumerate(ops):
        kernel, attrs = ((2, 2), {"strides": [2, 2]}) if op == "ConvTranspose" else ((3, 3), {"pads": [1, 1, 1, 1]})
        inits.append(numpy_helper.from_array(np.ones((4, 4, *kernel), np.float32) * 0.1, f"w{i}"))
        out = "y" if i == len(ops) - 1 else f"h{i}"
        nodes.append(helper.make_node(op, [last, f"w{i}"], [out], name=f"{op.lower()}{i}", **attrs))
        last = out
    return save_x_to_y(path, nodes, inits, ["n", 4, 4, 4])


def _said(tmp_path: Path, src: Path, caplog: pytest.LogCaptureFixture) -> str:
    """The warning that nothing was quantized, for ``src``."""
    _SAID_FLOAT.discard(src)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kiln.calibration"):
        quantize_int8_dynamic(src, tmp_path / "q.onnx", CalibrationConfig(ort_cpu_scheme="dynamic"))
    return next(r.getMessage() for r in caplog.records if "no MatMul or LSTM was quantized" in r.getMessage())


def test_a_conv_transpose_graph_is_not_sent_to_the_static_scheme(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    said = _said(tmp_path, _graph(tmp_path / "up.onnx", "ConvTranspose", "ConvTranspose"), caplog)
    assert "ort_cpu_scheme: static" not in said and "static quantizes" not in said, said
    assert "no integer kernel for ConvTranspose under either scheme" in said, said
    assert "static computes only Conv, MatMul and Gemm in int8" in said and "nn.Upsample + Conv2d" in said, said


def test_a_conv_graph_is_sent_to_static_with_its_kernel(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    said = _said(tmp_path, _graph(tmp_path / "cnn.onnx", "Conv", "Conv"), caplog)
    assert "calibration.ort_cpu_scheme: static computes its Conv layers in int8 (QLinearConv)" in said, said
    mixed = _said(tmp_path, _graph(tmp_path / "mixed.onnx", "ConvTranspose", "Conv"), caplog)
    assert "static would compute its 1 Conv in int8 (QLinearConv), not its 1 ConvTranspose" in mixed, mixed
