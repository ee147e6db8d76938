"""The Python-backend model Kiln writes for Triton, driven directly: a real ONNX Runtime engine behind it, and a
stand-in for the few calls of Triton's ``triton_python_backend_utils`` it makes (the served tests in
tests/serve/test_server.py run it inside Triton itself)."""

from __future__ import annotations

import gc
import importlib.util
import json
import sys
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kiln.stages.engines.backend import SIDECAR, read_metadata
from kiln.stages.package.triton import model_config, write_python_model
from tests.serve.test_batching import doubling_engine  # noqa: F401  (the fixture: a real engine of y = 2 x)


def _triton_utils() -> types.ModuleType:
    """What the model calls of Triton's Python API; MetricFamily is left out, as a Triton without custom
    metrics has it (the model then serves without its phase timings)."""
    pb = types.ModuleType("triton_python_backend_utils")
    pb.Tensor = lambda name, array: (name, array)
    pb.InferenceResponse = lambda output_tensors=None, error=None: SimpleNamespace(outputs=output_tensors, error=error)
    pb.TritonError = type("TritonError", (str,), {"INVALID_ARG": 3, "__new__": lambda cls, m, code=None: f"{code}:{m}"})
    pb.get_input_tensor_by_name = lambda request, name: SimpleNamespace(as_numpy=lambda: request[name])
    pb.triton_string_to_numpy = {"TYPE_FP32": np.float32}.__getitem__
    return pb


def _model(target: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", _triton_utils())
    spec = importlib.util.spec_from_file_location("kiln_stub_model", target / "1" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TritonPythonModel()


def test_the_model_answers_each_request_and_freezes_what_start_up_built(
    doubling_engine: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    meta = read_metadata(doubling_engine)
    target = tmp_path / "double"
    write_python_model(target, doubling_engine, meta, 8)
    # a record that leaves axis 1 to the graph, so that a request of 4 there passes the stub's own check and fails
    # the engine (its graph fixes 3): a batch the engine cannot run
    loose = [spec.model_copy(update={"shape": ["batch", "features"]}) for spec in meta.inputs]
    meta.model_copy(update={"inputs": loose}).write(target / "1" / "engine" / SIDECAR)
    args = {"model_repository": str(target), "model_version": "1", "model_name": "double"}
    args["model_config"] = json.dumps(model_config("double", meta, 8, "python"))
    model = _model(target, monkeypatch)
    gc.unfreeze()
    try:
        model.initialize(args)
        # start-up's objects (torch's, ONNX Runtime's, the engine's) out of the collector's sight
        assert gc.get_freeze_count() > 1000
        assert model.runner.serving  # opened as a server's engine: no busy-waiting between calls
        one, two = model.execute([{"x": np.full((n, 3), n, np.float32)} for n in (1, 2)])
        assert one.error is None and one.outputs[0][0] == "y" and (one.outputs[0][1] == 2).all()
        assert two.outputs[0][1].shape == (2, 3) and (two.outputs[0][1] == 4).all()
        # a batch the engine cannot run: each request alone, so that only the one it refuses gets the error
        good, bad = model.execute([{"x": np.ones((1, 3), np.float32)}, {"x": np.ones((1, 4), np.float32)}])
        assert good.error is None and (good.outputs[0][1] == 2).all()
        assert bad.outputs is None and bad.error.startswith("3:the engine failed on this request")  # 400
        # alone, ONNX Runtime's INVALID_ARGUMENT says it is the request's fault: a 400 still
        [alone] = model.execute([{"x": np.ones((1, 4), np.float32)}])
        assert alone.outputs is None and alone.error.startswith("3:the engine failed on this request")
        assert (model.execute([{"x": np.ones((1, 3), np.float32)}])[0].outputs[0][1] == 2).all()
        run = model._run
        model._run = lambda feeds: (_ for _ in ()).throw(RuntimeError("out of memory"))  # the engine's own failure
        [alone] = model.execute([{"x": np.ones((1, 3), np.float32)}])  # nothing tells it from a failed engine: a 500
        assert alone.outputs is None and alone.error.startswith("None:the engine failed on this request")
        model._run = run
    finally:
        gc.unfreeze()
        model.finalize()
