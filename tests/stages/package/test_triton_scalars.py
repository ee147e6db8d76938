"""A 0-d tensor (a mixture-of-experts model's scalar ``aux_loss``): Triton takes no empty ``dims`` and refuses the
``reshape`` to ``[]`` in a model without batching, so its configs declare ``dims: [ 1 ]``, the Python-backend model
turns the engine's ``[]`` into ``[1]`` and back, and the stock repository leaves the engine out with a warning."""

import json
import logging
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from google.protobuf import text_format
from onnx import TensorProto, helper

from kiln.core.errors import ModelError
from kiln.core.records import Baseline, EngineValidation, ValidationResult
from kiln.stages.engines.backend import read_metadata
from kiln.stages.engines.config import BuildConfig
from kiln.stages.engines.onnxruntime.config import OnnxRuntimeConfig
from kiln.stages.engines.stage import build_engine
from kiln.stages.package.stage import run
from kiln.stages.package.triton import check_config, model_config, write_stock_model
from tests.conftest import stage_context
from tests.stages.package.test_model_py import _model

model_config_pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2", reason="needs tritonclient")


def _scalar_graph(path: Path) -> Path:
    """x [batch, 4], scale [] -> y [batch, 4] (x * scale), total [] (the sum of x)."""
    nodes = [
        helper.make_node("Mul", ["x", "scale"], ["y"]),
        helper.make_node("ReduceSum", ["x"], ["total"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "scalars",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4]),
            helper.make_tensor_value_info("scale", TensorProto.FLOAT, []),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4]),
            helper.make_tensor_value_info("total", TensorProto.FLOAT, []),
        ],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@pytest.fixture
def packaged(tmp_path: Path, tiny_config, caplog: pytest.LogCaptureFixture) -> tuple[Path, dict, list[str]]:
    """The package stage run on a validated engine of :func:`_scalar_graph`: its folder, model record, warnings."""
    cfg = BuildConfig(backends=["onnxruntime"], onnxruntime=OnnxRuntimeConfig(autotune={"cpu": False}))
    (tmp_path / "build").mkdir()
    graph = _scalar_graph(tmp_path / "build" / "scalars.onnx")
    meta = build_engine(graph, tmp_path / "build" / "engine", "onnxruntime", "cpu", "fp32", cfg, tmp_path / "cache")
    checked = EngineValidation(
        name=meta.name, backend=meta.backend, precision="fp32", device="cpu", status="validated", passed=True
    )
    checked.batch_sizes = [1, 4]
    (tmp_path / "validate").mkdir()
    ValidationResult(
        passed=True, baseline=Baseline(accuracy=None, samples=4, latency_ms={}), engines=[checked], failures=[]
    ).write(tmp_path / "validate" / "validation.json")
    inputs = {"build": tmp_path / "build", "validate": tmp_path / "validate"}
    ctx = stage_context("package", tiny_config, tmp_path, tmp_path / "package", inputs)
    with caplog.at_level(logging.INFO):
        model = run(ctx).models[0]
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    return tmp_path / "package", model, warned


def test_a_0d_tensor_is_declared_dims_1_and_the_stock_repository_leaves_the_engine_out(packaged) -> None:
    out, model, warned = packaged
    text = (out / "triton-python" / model["triton_python_model"] / "config.pbtxt").read_text()
    cfg = text_format.Parse(text, model_config_pb2.ModelConfig())
    assert cfg.max_batch_size == 0
    assert {t.name: list(t.dims) for t in [*cfg.input, *cfg.output]} == {
        "x": [-1, 4],
        "scale": [1],
        "y": [-1, 4],
        "total": [1],
    }
    assert not any(t.HasField("reshape") for t in [*cfg.input, *cfg.output])  # refused by Triton without batching
    assert "triton_model" not in model and not (out / "triton").exists()
    assert any("left out of triton/" in m and "['scale', 'total']" in m for m in warned), warned


def test_the_config_check_refuses_empty_dims_and_the_stock_writer_a_0d_tensor(packaged) -> None:
    out, model, _ = packaged
    meta = read_metadata(out / "engines" / model["engine"])
    cfg = model_config("m", meta, 8, backend="python")
    cfg["output"][1]["dims"] = []
    with pytest.raises(ModelError, match=r"output 'total': dims \[\] do not match"):
        check_config(cfg, meta)
    with pytest.raises(ModelError, match=r"0-d tensors \['scale', 'total'\], which stock Triton backends cannot"):
        write_stock_model(out / "stock", out / "engines" / model["engine"], meta, 8)


def test_the_python_backend_model_takes_and_gives_a_0d_tensor_as_1(packaged, monkeypatch) -> None:
    out, model, _ = packaged
    target = out / "triton-python" / model["triton_python_model"]
    args = {"model_repository": str(target), "model_version": "1", "model_name": "m"}
    args["model_config"] = json.dumps(model_config("m", read_metadata(target / "1" / "engine"), 8, "python"))
    stub = _model(target, monkeypatch)
    stub.initialize(args)
    try:
        [answer] = stub.execute([{"x": np.ones((2, 4), np.float32), "scale": np.array([3.0], np.float32)}])
        assert answer.error is None, answer.error
        got = dict(answer.outputs)
        assert got["y"].shape == (2, 4) and (got["y"] == 3).all()
        assert got["total"].shape == (1,) and got["total"][0] == 8
    finally:
        stub.finalize()
    sys.modules.pop("kiln_stub_model", None)
