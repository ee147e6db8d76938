"""A tensor NaN on every calibration sample (a Sqrt of negative values): its nodes stay in float and the rest is
quantized, instead of ONNX Runtime's quantizer stopping on its bare "scale issue"; numpy's All-NaN warnings and the
quantizer's root-logger lines reach Kiln's debug log, not the user's console; where the quantizer still fails that
way, its error says what it means."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.calibration.config import CalibrationConfig
from kiln.calibration.quantize import quantize_int8, quantizer_failed
from kiln.calibration.quiet import ort_said_to_debug
from kiln.calibration.ranges import calibrate


def nan_branch_onnx(path: Path) -> Path:
    """x [batch, 4] -> MatMul -> h (finite); Sqrt(-|x|) -> s (NaN) -> MatMul -> y [batch, 3] (NaN)."""
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w1"], ["h"], name="good"),
            helper.make_node("Abs", ["x"], ["a"], name="abs"),
            helper.make_node("Neg", ["a"], ["n"], name="neg"),
            helper.make_node("Sqrt", ["n"], ["s"], name="sqrt"),
            helper.make_node("MatMul", ["s", "w2"], ["y"], name="bad"),
        ],
        "nan_branch",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [
            helper.make_tensor_value_info("h", TensorProto.FLOAT, ["batch", 3]),
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3]),
        ],
        [
            numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "w1"),
            numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "w2"),
        ],
    )
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def _batches() -> list[np.ndarray]:
    rng = np.random.default_rng(1)
    return [rng.standard_normal((8, 4)).astype(np.float32) + 0.5 for _ in range(4)]


def test_a_nan_tensor_stays_float_and_the_rest_is_quantized(tmp_path: Path) -> None:
    model = nan_branch_onnx(tmp_path / "m.onnx")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        ranges = calibrate(model, _batches(), "x", "minmax", cache_dir=tmp_path)
    assert not [w for w in said if "All-NaN" in str(w.message)], [str(w.message) for w in said]
    assert "y" in ranges.nan_bounded()
    out = quantize_int8(model, tmp_path / "q.onnx", ranges, CalibrationConfig())
    assert "bad" in out["excluded"] and "good" not in out["excluded"]
    q = onnx.load(str(tmp_path / "q.onnx"))
    assert any(n.op_type == "DequantizeLinear" for n in q.graph.node)


def test_scale_issue_is_said_in_words(tmp_path: Path) -> None:
    model = nan_branch_onnx(tmp_path / "m.onnx")
    ranges = calibrate(model, _batches(), "x", "minmax", cache_dir=None)
    err = quantizer_failed("quantize_static", AssertionError("scale issue"), onnx.load(str(model)), "int8", ranges)
    assert "NaN" in err.message and "'s', 'y'" in err.message, err.message
    assert "calibration.exclude_nodes=[sqrt, bad]" in err.hint, err.hint


def test_quantizer_root_log_lines_go_to_the_debug_log(caplog: pytest.LogCaptureFixture) -> None:
    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append  # type: ignore[method-assign]
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        with caplog.at_level(logging.DEBUG, logger="kiln.calibration"), ort_said_to_debug("quantize_static"):
            for _ in range(4):
                logging.warning("failed to infer the type of tensor: g. Skip to quantize it. Please check.")
            logging.getLogger("kiln.calibration").warning("kiln's own")
    finally:
        root.removeHandler(handler)
    # the library's lines reach no handler as they are; Kiln's own record still does
    assert not [r for r in seen if r.name == "root"] and "kiln's own" in [r.getMessage() for r in seen]
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert any("failed to infer" in m and "(4 times)" in m for m in debug), debug
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(info) == 1 and "(g)" in info[0], info
