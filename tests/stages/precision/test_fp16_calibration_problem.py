"""FP16 needs no calibration scales: calibration data that gives no usable ranges fails INT8 alone."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.calibration.config import CalibrationConfig
from kiln.calibration.data import reader_batches
from kiln.core.onnx_io import io_specs
from kiln.core.progress import SilentProgress
from kiln.stages.precision.config import PrecisionConfig
from kiln.stages.precision.stage import build_variants
from kiln.stages.precision.variants import Source
from tests.calibration.calib_graphs import batches, conv_model


def test_calibration_data_without_ranges_fails_int8_not_fp16(tmp_path: Path) -> None:
    """All-zero calibration batches (an input whose range is 0) cannot give INT8 scales: INT8 fails with that
    reason, while FP16, whose range check is the only use it makes of them, is made without the check and says so."""
    zeros = [np.zeros_like(b) for b in batches()]
    src = Source.prepare(conv_model(), tmp_path / "fp32" / "model.onnx", zeros, tmp_path / "cache")
    x_val = np.random.default_rng(1).random((64, 1, 8, 8), dtype=np.float32)
    variants, failed = build_variants(
        src,
        tmp_path,
        ["fp32", "fp16", "int8"],
        PrecisionConfig(),
        CalibrationConfig(),
        x_val,
        SilentProgress(),
        logging.getLogger("test"),
    )
    assert set(failed) == {"int8"} and "is 0 in every sample" in failed["int8"].message
    assert set(variants) == {"fp32", "fp16"} and (tmp_path / variants["fp16"]["path"]).is_file()
    assert variants["fp16"]["range_check"].startswith("skipped: calibration input 'input' is 0 in every sample")


def _state_model() -> onnx.ModelProto:
    """A tiny recurrent step: logits from an input ``x`` and a state ``h0`` (zeros at a sequence's start)."""
    rng = np.random.default_rng(0)
    w = lambda *s: numpy_helper.from_array((rng.standard_normal(s) * 0.3).astype(np.float32))  # noqa: E731
    inits = [w(8, 16), w(6, 16), w(16, 10)]
    for init, name in zip(inits, ("wx", "wh", "wo")):
        init.name = name
    nodes = [
        helper.make_node("MatMul", ["x", "wx"], ["a"], name="in_x"),
        helper.make_node("MatMul", ["h0", "wh"], ["b"], name="in_h"),
        helper.make_node("Add", ["a", "b"], ["s"], name="add"),
        helper.make_node("Relu", ["s"], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", "wo"], ["logits"], name="head"),
    ]
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8]),
        helper.make_tensor_value_info("h0", TensorProto.FLOAT, ["batch", 6]),
    ]
    out = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])]
    model = helper.make_model(
        helper.make_graph(nodes, "g", inputs, out, inits), opset_imports=[helper.make_opsetid("", 18)]
    )
    model.ir_version = 9
    return model


def test_a_reader_input_of_zeros_beside_real_data_fails_int8_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader whose state input is 0 in every sample while ``x`` varies is real data, not a mistake: its batches
    are read, FP32 and FP16 are made from them, and INT8, which has no scale for the state, fails alone."""
    (tmp_path / "state_calib.py").write_text(
        "import numpy as np\nrng = np.random.default_rng(0)\ndef reader():\n    for _ in range(4):\n"
        "        yield {'x': rng.random((16, 8), dtype=np.float32), 'h0': np.zeros((16, 6), np.float32)}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    model, ccfg = _state_model(), CalibrationConfig(reader="state_calib:reader")
    got = reader_batches(ccfg, io_specs(model)[0])
    src = Source.prepare(model, tmp_path / "fp32" / "model.onnx", got, tmp_path / "cache")
    rng = np.random.default_rng(1)
    x_val = {"x": rng.random((64, 8), dtype=np.float32), "h0": rng.random((64, 6), dtype=np.float32)}
    variants, failed = build_variants(
        src, tmp_path, ["fp32", "fp16", "int8"], PrecisionConfig(), ccfg, x_val, SilentProgress(), logging.getLogger()
    )
    assert set(failed) == {"int8"} and "calibration input 'h0' is 0 in every sample" in failed["int8"].message
    assert set(variants) == {"fp32", "fp16"} and (tmp_path / variants["fp16"]["path"]).is_file()
