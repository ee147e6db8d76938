"""`kiln loadtest --model` a name it cannot test: the names offered are those of the engines under the path given,
and a running server that serves no such model is told from one that is not there, with the models it serves."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.core.errors import ConfigError, KilnError
from kiln.serve import loadtest
from kiln.serve.loadtest import engine_for, server_batches
from kiln.stages.engines.backend import read_metadata
from kiln.stages.engines.config import BuildConfig
from kiln.stages.engines.stage import build_direct
from kiln.stages.package import INDEX


def _package(root: Path) -> Path:
    """A package of one engine (y = 2 x) whose record also names another engine's Triton models; the engine's
    folder."""
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "two"], ["y"])],
        "double",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        [numpy_helper.from_array(np.array(2.0, np.float32), "two")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), root / "m.onnx")
    folder = root / "package" / "engines" / "this"
    build_direct(root / "m.onnx", folder, "onnxruntime", "cpu", None, BuildConfig())
    this = read_metadata(folder).name
    models = [
        {"engine": this, "triton_model": "this_model", "triton_python_model": "this_python"},
        {"engine": "other-engine", "triton_model": "other_model", "triton_python_model": "other_python"},
    ]
    (root / "package" / INDEX).write_text(json.dumps({"models": models}))
    return folder


def test_a_name_refused_under_an_engine_folder_is_not_offered_with_another_engines(tmp_path: Path) -> None:
    folder = _package(tmp_path)
    assert engine_for(folder, "this_python").engine_dir == folder.resolve()
    with pytest.raises(ConfigError, match="no engine served as 'other_model'") as err:
        engine_for(folder, "other_model")
    assert "this_model" in err.value.hint and "this_python" in err.value.hint, err.value.hint
    assert "other" not in err.value.hint, err.value.hint


def _triton(index: Any) -> SimpleNamespace:
    """A stand-in for tritonclient.http whose server has no model 'm' and the repository index ``index`` (an
    exception: the index is not readable either)."""

    class Client:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def get_inference_statistics(self, model: str) -> dict:
            raise RuntimeError(f"[400] requested model '{model}' is not available")

        def get_model_repository_index(self) -> list[dict]:
            if isinstance(index, Exception):
                raise index
            return index

        def close(self) -> None:
            pass

    return SimpleNamespace(InferenceServerClient=Client)


def test_a_running_server_without_the_model_says_the_models_it_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    index = [{"name": "a", "version": "1", "state": "READY"}, {"name": "b", "state": "UNAVAILABLE"}]
    monkeypatch.setattr(loadtest, "_client_module", lambda protocol: _triton(index))
    with pytest.raises(ConfigError, match="serves no model 'm'") as err:
        server_batches("http", "127.0.0.1:1", "m")
    assert err.value.hint == "--model is one of ['a']" and "start the server" not in err.value.hint


def test_a_server_not_there_is_still_told_to_be_started(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loadtest, "_client_module", lambda protocol: _triton(ConnectionRefusedError(111, "refused")))
    with pytest.raises(KilnError, match="cannot read model 'm' statistics") as err:
        server_batches("http", "127.0.0.1:1", "m")
    assert "start the server first" in err.value.hint
