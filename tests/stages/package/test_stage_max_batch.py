"""The Triton repositories' ``max_batch_size``: at its default, ``package.max_batch_size`` takes the largest batch
validation compared the engine at where that is more (servers take batches up to it); set in the config, it is kept,
and a value below the validated batches is said."""

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
from tests.conftest import config_from_dict, stage_context, tiny_config_dict


def _linear(path: Path) -> Path:
    """x [batch, 4] -> y [batch, 3]."""
    w = numpy_helper.from_array(np.ones((4, 3), np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
        [w],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def _package(tmp_path: Path, **overrides) -> str:
    """The stock Triton config.pbtxt of an engine validated at batches [1, 64], packaged with ``overrides``."""
    (tmp_path / "build").mkdir()
    graph = _linear(tmp_path / "build" / "linear.onnx")
    cfg = BuildConfig(backends=["onnxruntime"], onnxruntime=OnnxRuntimeConfig(autotune={"cpu": False}))
    meta = build_engine(graph, tmp_path / "build" / "engine", "onnxruntime", "cpu", "fp32", cfg, tmp_path / "cache")
    checked = EngineValidation(
        name=meta.name, backend=meta.backend, precision="fp32", device="cpu", status="validated", passed=True
    )
    checked.batch_sizes = [1, 64]
    (tmp_path / "validate").mkdir()
    ValidationResult(
        passed=True, baseline=Baseline(accuracy=None, samples=8, latency_ms={}), engines=[checked], failures=[]
    ).write(tmp_path / "validate" / "validation.json")
    config = config_from_dict(tiny_config_dict(**{"signature.batch_sizes": [1, 64], **overrides}))
    inputs = {"build": tmp_path / "build", "validate": tmp_path / "validate"}
    model = run(stage_context("package", config, tmp_path, tmp_path / "package", inputs)).models[0]
    return (tmp_path / "package" / "triton" / model["triton_model"] / "config.pbtxt").read_text()


def test_the_default_max_batch_takes_the_largest_validated_batch(tmp_path: Path) -> None:
    assert "max_batch_size: 64\n" in _package(tmp_path)


def test_a_max_batch_set_below_the_validated_batches_is_kept_and_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        text = _package(tmp_path, **{"package.max_batch_size": 32})
    assert "max_batch_size: 32\n" in text
    said = [r.getMessage() for r in caplog.records if "below the largest validated batch 64" in r.getMessage()]
    assert len(said) == 1 and "package.max_batch_size 32" in said[0], said


def test_the_ray_app_takes_the_largest_validated_batch_too(tmp_path: Path) -> None:
    """Ray's own max_batch_size follows the same rule as the Triton repositories: at its default, the largest batch
    validated; set, kept."""
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    _package(tmp_path / "a", **{"package.ray.enabled": True})
    assert "max_batch_size: 64\n" in (tmp_path / "a" / "package" / "ray" / "serve.yaml").read_text()
    _package(tmp_path / "b", **{"package.ray.enabled": True, "package.ray.max_batch_size": 8})
    assert "max_batch_size: 8\n" in (tmp_path / "b" / "package" / "ray" / "serve.yaml").read_text()
