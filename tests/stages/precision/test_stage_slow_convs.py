"""The precision stage says before validation that an INT8 graph for ONNX Runtime CPU quantizes 3-D convolutions,
which ORT's CPU QLinearConv computes without a fast path (INT8 then runs slower than FP32); 2-D ones are not
said, and nothing built changes."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.calibration.config import CalibrationConfig
from kiln.calibration.quantize import quantize_int8
from kiln.stages.precision.stage import _warn_slow_convs
from kiln.stages.precision.variants import Source


def conv_graph(dims: int) -> onnx.ModelProto:
    """Conv over ``dims`` spatial dims (3: a Conv3d) -> GlobalAveragePool -> Flatten (logits)."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((4, 2, *[3] * dims)) * 0.3).astype(np.float32)
    nodes = [
        helper.make_node("Conv", ["input", "w"], ["c"], name=f"conv{dims}d", pads=[1] * 2 * dims),
        helper.make_node("GlobalAveragePool", ["c"], ["p"], name="pool"),
        helper.make_node("Flatten", ["p"], ["logits"], name="flat"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 2, *[4] * dims])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 4])],
        [numpy_helper.from_array(w, "w")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def quantized(tmp: Path, dims: int) -> Path:
    """The Q/DQ graph Kiln's calibration writes for :func:`conv_graph` at ``tmp/int8/model.onnx``."""
    cal = [np.random.default_rng(1).standard_normal((4, 2, *[4] * dims)).astype(np.float32)]
    src = Source.prepare(conv_graph(dims), tmp / "fp32" / "model.onnx", cal, None)
    ccfg = CalibrationConfig(cache=False)
    out = tmp / "int8" / "model.onnx"
    quantize_int8(src.path, out, src.ranges(ccfg.method, ccfg), ccfg, set())
    return out


@pytest.mark.parametrize("dims", [2, 3])
def test_int8_3d_convolutions_on_ort_cpu_are_warned_of(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, dims: int
) -> None:
    quantized(tmp_path, dims)
    entry = {"path": "int8/model.onnx", "kept_fp32": []}
    log = logging.getLogger("kiln.precision")
    with caplog.at_level(logging.WARNING, logger="kiln.precision"):
        _warn_slow_convs(log, tmp_path, "int8", entry)
        _warn_slow_convs(log, tmp_path, "int8", {**entry, "unmade": "int8 not made"})  # no engine loads it
    said = [r.getMessage() for r in caplog.records]
    if dims == 2:
        assert said == []
        return
    assert said == [
        "int8: 1 3-D convolution (conv3d) run in INT8 on ONNX Runtime CPU as QLinearConv, which has no fast path over "
        "3 spatial dims: expect its ONNX Runtime CPU engine to run slower than FP32; set precision.require_speedup: "
        "true to leave an INT8 engine slower than FP32 out of the package (TensorRT's INT8 engines, fast on 3-D "
        "convolutions, stay); calibration.exclude_op_types: [Conv] would instead remove INT8 from every backend"
    ]
