"""`kiln validate ENGINE --reference ...` reads validate.metric: a bad import path is an error, a metric of the
user's scores the engine's outputs against the reference's (its inputs carry no labels) and is gated by
max_metric_drop, and a built-in, which needs labels, is said not to be scored."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.pipeline.test_faults import assert_clean, invoke

W = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
METRIC = '''
import numpy as np


def close(outputs, labels):
    """The share of output values within 0.05 of the reference's."""
    return float(np.mean(np.abs(outputs["y"] - labels["y"]) <= 0.05))
'''


def _linear(path: Path, w: np.ndarray) -> Path:
    """input [batch, 4] -> y [batch, 3] = input @ ``w``."""
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["input", "w"], ["y"])],
        "linear",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
        [numpy_helper.from_array(w, "w")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    return path


def _validate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *sets: str) -> Any:
    """An engine whose weights are 0.1 off its reference's (about 0.3 of its values within 0.05), validated on
    inputs without labels with each ``--set`` of ``sets``."""
    (tmp_path / "directmetric.py").write_text(METRIC)
    monkeypatch.syspath_prepend(str(tmp_path))
    engine, inputs = tmp_path / "e", tmp_path / "x.npz"
    assert invoke("build", _linear(tmp_path / "engine.onnx", W + 0.1), "-o", engine).exit_code == 0
    np.savez(inputs, input=np.random.default_rng(1).standard_normal((32, 4)).astype(np.float32))
    model = _linear(tmp_path / "m.onnx", W)
    return invoke(
        "validate", engine, "--reference", model, "--inputs", inputs, *(a for s in sets for a in ("--set", s))
    )


def _json(result: Any) -> dict[str, Any]:
    return json.loads(result.output[result.output.index("{") : result.output.rindex("}") + 1])


def test_a_bad_metric_path_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert_clean(_validate(tmp_path, monkeypatch, "validate.metric=directmetric:nonexistent"), 2, "validate.metric")


def test_a_users_metric_is_scored_against_the_reference_and_gated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    failed = _validate(tmp_path, monkeypatch, "validate.metric=directmetric:close")
    got = _json(failed)
    assert 0 < got["metric"] < 0.9 and got["gates"]["max_metric_drop"] == 0.01, got
    assert any("directmetric:close" in f and "max_metric_drop" in f for f in got["failures"]), got["failures"]
    loose = _json(
        _validate(tmp_path, monkeypatch, "validate.metric=directmetric:close", "validate.gates.max_metric_drop=1")
    )
    assert loose["metric"] == got["metric"] and not any("max_metric_drop" in f for f in loose.get("failures", []))


def test_a_builtin_metric_is_said_not_to_be_scored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    result = _validate(tmp_path, monkeypatch, "validate.metric=mse")
    assert "metric" not in _json(result)
    assert "validate.metric 'mse' is not scored here" in result.output, result.output
