"""An engine Triton serves unbatched for a reason the user can fix (a CTC model's ``[batch]`` lengths): the package
stage warns with the reason, as ``kiln serve`` does, rather than writing ``max_batch_size: 0`` silently."""

import logging
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.core.records import Baseline, EngineValidation, ValidationResult
from kiln.stages.engines.config import BuildConfig
from kiln.stages.engines.onnxruntime.config import OnnxRuntimeConfig
from kiln.stages.engines.stage import build_engine
from kiln.stages.package.stage import run
from tests.conftest import stage_context


def _ctc_graph(path: Path) -> Path:
    """features [batch, frames, 4], lengths [batch] -> logits [batch, frames, 3], out_lengths [batch]."""
    w = numpy_helper.from_array(np.ones((4, 3), np.float32), "w")
    nodes = [
        helper.make_node("MatMul", ["features", "w"], ["logits"]),
        helper.make_node("Identity", ["lengths"], ["out_lengths"]),
    ]
    graph = helper.make_graph(
        nodes,
        "ctc",
        [
            helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", "frames", 4]),
            helper.make_tensor_value_info("lengths", TensorProto.INT64, ["batch"]),
        ],
        [
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "frames", 3]),
            helper.make_tensor_value_info("out_lengths", TensorProto.INT64, ["batch"]),
        ],
        [w],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_a_ctc_engine_packaged_unbatched_is_a_warning_naming_why(
    tmp_path: Path, tiny_config, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = BuildConfig(backends=["onnxruntime"], onnxruntime=OnnxRuntimeConfig(autotune={"cpu": False}))
    (tmp_path / "build").mkdir()
    graph = _ctc_graph(tmp_path / "build" / "ctc.onnx")
    meta = build_engine(
        graph,
        tmp_path / "build" / "engine",
        "onnxruntime",
        "cpu",
        "fp32",
        cfg,
        tmp_path / "cache",
        axis_sizes={"frames": [2, 8]},
    )
    checked = EngineValidation(
        name=meta.name, backend=meta.backend, precision="fp32", device="cpu", status="validated", passed=True
    )
    checked.batch_sizes = [1, 8]
    (tmp_path / "validate").mkdir()
    validation = ValidationResult(
        passed=True, baseline=Baseline(accuracy=None, samples=8, latency_ms={}), engines=[checked], failures=[]
    )
    validation.write(tmp_path / "validate" / "validation.json")
    inputs = {"build": tmp_path / "build", "validate": tmp_path / "validate"}
    ctx = stage_context("package", tiny_config, tmp_path, tmp_path / "package", inputs)
    with caplog.at_level(logging.INFO):
        model = run(ctx).models[0]
    text = (tmp_path / "package" / "triton" / model["triton_model"] / "config.pbtxt").read_text()
    assert "max_batch_size: 0\n" in text
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("packaged for Triton unbatched" in m and "input 'lengths' is [batch]" in m for m in warned), warned
    assert any("output 'out_lengths' is [batch]" in m and "[batch, 1]" in m for m in warned), warned
