"""A tiny LSTM forecaster as an ONNX Runtime CPU engine, written with onnx.helper (no export): ONNX Runtime's LSTM
kernel aborts the process on a batch of 0 rows (an upstream bug), which Kiln must refuse before it runs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kiln.core.records import EngineMetadata
from kiln.stages.engines.config import BuildConfig
from kiln.stages.engines.onnxruntime.config import OnnxRuntimeConfig
from kiln.stages.engines.stage import build_engine

FEATURES, HIDDEN = 2, 3


def lstm_graph(path: Path, squeezed: bool) -> Path:
    """``input [batch, time, 2]`` -> an LSTM's last hidden state summed to ``forecast``: ``[batch]`` when
    ``squeezed`` (a regression's squeezed output: served unbatched), else ``[batch, 3]``."""
    rng = np.random.default_rng(0)
    weights = [
        numpy_helper.from_array(rng.standard_normal((1, 4 * HIDDEN, n)).astype(np.float32), name)
        for name, n in (("W", FEATURES), ("R", HIDDEN))
    ]
    axes = numpy_helper.from_array(np.array([0, 2] if squeezed else [0], np.int64), "axes")
    nodes = [
        helper.make_node("Transpose", ["input"], ["x"], perm=[1, 0, 2]),  # ONNX Runtime's LSTM takes time first
        helper.make_node("LSTM", ["x", "W", "R"], ["", "h"], hidden_size=HIDDEN),
        helper.make_node("ReduceSum", ["h", "axes"], ["forecast"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "lstm",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", "time", FEATURES])],
        [helper.make_tensor_value_info("forecast", TensorProto.FLOAT, ["batch"] if squeezed else ["batch", HIDDEN])],
        [*weights, axes],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    return path


def lstm_engine(folder: Path, squeezed: bool = True) -> tuple[Path, EngineMetadata]:
    """The engine folder and its metadata, validated for time from 2 to 6."""
    cfg = BuildConfig(backends=["onnxruntime"], onnxruntime=OnnxRuntimeConfig(autotune={"cpu": False}))
    out = folder / "engine"
    graph = lstm_graph(folder / "lstm.onnx", squeezed)
    meta = build_engine(graph, out, "onnxruntime", "cpu", "fp32", cfg, folder / "cache", axis_sizes={"time": [2, 6]})
    return out, meta
