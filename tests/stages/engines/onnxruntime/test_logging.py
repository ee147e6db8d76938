"""ONNX Runtime's own log lines follow Kiln's logger: a successful build prints no ORT error lines (issue 12)."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as h
import pytest

from kiln.stages.engines.config import BuildConfig
from kiln.stages.engines.onnxruntime.config import OnnxRuntimeConfig, OrtAutotuneConfig
from kiln.stages.engines.stage import build_engine


def batch_one_only(path: Path) -> Path:
    """Declares a dynamic batch but reshapes to batch 1: batch 4 fails inside ORT's Reshape kernel, which ORT
    reports with an ERROR line of its own besides the exception (like cuDNN's plan search on the GPU)."""
    shape = onnx.numpy_helper.from_array(np.array([1, 16], np.int64), "shape")
    graph = h.make_graph(
        [h.make_node("Reshape", ["x", "shape"], ["r"]), h.make_node("Relu", ["r"], ["y"])],
        "g",
        [h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 16])],
        [h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["batch", 16])],
        [shape],
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


@pytest.mark.parametrize("level", [logging.INFO, logging.DEBUG])
def test_successful_build_prints_ort_error_lines_only_when_kiln_debugs(tmp_path: Path, capfd, level: int) -> None:
    kiln_log = logging.getLogger("kiln")
    old = kiln_log.level
    kiln_log.setLevel(level)
    try:
        cfg = BuildConfig(
            backends=["onnxruntime"],
            onnxruntime=OnnxRuntimeConfig(
                autotune=OrtAutotuneConfig(
                    cpu=True, batch_sizes=[1, 4], iterations=3, warmup=1, cpu_knobs={"intra_op_threads": [0]}
                )
            ),
        )
        meta = build_engine(
            batch_one_only(tmp_path / "m.onnx"), tmp_path / "e", "onnxruntime", "cpu", "fp32", cfg, tmp_path / "c"
        )
    finally:
        kiln_log.setLevel(old)
    assert "Reshape" in meta.backend_info["autotune"]["trials"][0]["by_batch"][1]["error"]  # the failure reached Kiln
    err = capfd.readouterr().err  # file-descriptor level: ORT writes from C++
    printed = [line for line in err.splitlines() if "[E:onnxruntime" in line]
    assert bool(printed) == (level == logging.DEBUG), err[-2000:]
