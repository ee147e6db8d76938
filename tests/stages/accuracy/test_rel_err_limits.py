"""The relative-error limits an engine is held to: recorded in its gates where ``max_rel_err`` is unset (the limit is
then derived from ``min_cosine``), and a failure over a small spread naming the settings that accept it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kiln.core.records import EngineValidation
from kiln.stages.accuracy.check import CheckConfig, accuracy_failures, compare_all, gates_for, summarize
from tests.pipeline.test_faults import invoke

RNG = np.random.default_rng(0)
W = RNG.standard_normal((4, 3)).astype(np.float32)  # the class logits' weights
V = RNG.standard_normal((4, 4)).astype(np.float32)  # the box head's: boxes vary little around their anchor


def _detector(x: np.ndarray, v: np.ndarray) -> dict[str, np.ndarray]:
    """An undertrained detector: class logits, and boxes near one anchor (100) whatever the image."""
    return {"logits": x @ W, "boxes": 100.0 + 0.3 * (x @ v)}


def _judged(precision: str) -> tuple[EngineValidation, list[str]]:
    """The entry and failures of an engine of ``precision`` whose box head is slightly off, against the detector."""
    x = RNG.standard_normal((64, 4)).astype(np.float32)
    off = V + 0.5 * RNG.standard_normal(V.shape).astype(np.float32)
    stats = compare_all(_detector(x, V), _detector(x, off), "logits")
    entry = EngineValidation(name="e", backend="onnxruntime", precision=precision, device="cpu", status="validated")
    entry.gates = gates_for(CheckConfig(), precision)
    summarize(entry, stats, "logits")
    return entry, accuracy_failures(entry, entry.gates, None)


def test_a_box_error_over_a_small_spread_names_the_settings_that_accept_it() -> None:
    """In an INT8 engine the boxes' error is a large share of their little spread and a small one of their norm: the
    failure names the INT8 max_rel_err to set, or the gated_outputs that leave the boxes ungated."""
    entry, failures = _judged("int8")
    (failure,) = failures
    assert failure.startswith("output 'boxes' relative error") and "over its norm the error is" in failure
    assert "validate.gates.per_precision.int8.max_rel_err (which holds its class logits too)" in failure, failure
    assert "validate.gates.gated_outputs: [logits] to leave 'boxes' ungated" in failure, failure


def test_the_gates_record_the_derived_limits_and_the_outputs_they_hold() -> None:
    """``max_rel_err`` unset: the gates record the limit derived from min_cosine and the outputs held to it (the
    class logits too in FP32, not in INT8, where top-1 agreement guards them), and the record reads back."""
    entry, _ = _judged("int8")
    assert entry.gates["max_rel_err"] is None
    assert entry.gates["rel_err_limit"] == 0.141421 and entry.gates["rel_err_outputs"] == ["boxes"]
    entry, _ = _judged("fp32")
    assert entry.gates["rel_err_limit"] == 0.014142 and entry.gates["rel_err_outputs"] == ["logits", "boxes"]
    assert EngineValidation.model_validate(entry.model_dump(mode="json")).gates == entry.gates


def _onnx_detector(path: Path, v: np.ndarray) -> Path:
    """:func:`_detector` as an ONNX graph: input [batch, 4] -> logits [batch, 3], boxes [batch, 4]."""
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["input", "w"], ["logits"]),
            helper.make_node("MatMul", ["input", "v"], ["head"]),
            helper.make_node("Mul", ["head", "scale"], ["small"]),
            helper.make_node("Add", ["small", "anchor"], ["boxes"]),
        ],
        "detector",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 4])],
        [
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 3]),
            helper.make_tensor_value_info("boxes", TensorProto.FLOAT, ["batch", 4]),
        ],
        [
            numpy_helper.from_array(W, "w"),
            numpy_helper.from_array(v, "v"),
            numpy_helper.from_array(np.array(0.3, np.float32), "scale"),
            numpy_helper.from_array(np.array(100.0, np.float32), "anchor"),
        ],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    return path


def test_kiln_validate_json_says_the_limit_the_engine_failed(tmp_path: Path) -> None:
    """`kiln validate ENGINE --reference model.onnx --inputs x.npz`, the class logits named: the engine fails the
    boxes' derived relative-error limit, and its JSON's gates say that limit, not only max_rel_err null."""
    engine, inputs = tmp_path / "e", tmp_path / "x.npz"
    off = V + 0.5 * RNG.standard_normal(V.shape).astype(np.float32)
    assert invoke("build", _onnx_detector(tmp_path / "engine.onnx", off), "-o", engine).exit_code == 0
    np.savez(inputs, input=np.random.default_rng(1).standard_normal((32, 4)).astype(np.float32))
    model = _onnx_detector(tmp_path / "m.onnx", V)
    out = invoke(
        "validate", engine, "--reference", model, "--inputs", inputs, "--set", "signature.logits_output=logits"
    )
    assert out.exit_code == 3, out.output
    got: dict[str, Any] = json.loads(out.output[out.output.index("{") : out.output.index("\nerror:")])
    assert any(f.startswith("output 'boxes' relative error") for f in got["failures"]), got["failures"]
    assert "> max_rel_err 0.01414" in got["failures"][0] and got["gates"]["max_rel_err"] is None
    assert got["gates"]["rel_err_limit"] == 0.014142 and got["gates"]["rel_err_outputs"] == ["logits", "boxes"]
    assert "validate.gates.per_precision.fp32.max_rel_err" in got["failures"][0]
