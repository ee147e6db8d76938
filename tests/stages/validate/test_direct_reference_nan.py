"""`kiln validate ENGINE --reference REF.onnx` warns where the reference answers NaN, as the pipeline's validation
does, and its failure names the reference as the side without a number."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tests.pipeline.test_faults import invoke

RNG = np.random.default_rng(0)
W = RNG.standard_normal((4, 3)).astype(np.float32)


def _graph(path: Path, abs_first: bool) -> Path:
    """input [batch, 4] -> logits [batch, 3] = sqrt(input) @ W (NaN on a negative value), of |input| where
    ``abs_first``."""
    nodes = [helper.make_node("Abs", ["input"], ["a"])] if abs_first else []
    nodes += [
        helper.make_node("Sqrt", ["a" if abs_first else "input"], ["r"]),
        helper.make_node("MatMul", ["r", "w"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 3])],
        [numpy_helper.from_array(W, "w")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    return path


def test_the_reference_nan_is_warned_and_named(tmp_path: Path) -> None:
    engine, inputs = tmp_path / "e", tmp_path / "x.npz"
    assert invoke("build", _graph(tmp_path / "engine.onnx", True), "-o", engine).exit_code == 0
    x = np.abs(np.random.default_rng(1).standard_normal((32, 4))).astype(np.float32)
    x[[5, 9], 2] = -1.0
    np.savez(inputs, input=x)
    out = invoke("validate", engine, "--reference", _graph(tmp_path / "m.onnx", False), "--inputs", inputs)
    assert out.exit_code == 3, out.output
    assert "reference output 'logits' is NaN at 6 of 96 values, in 2 of 32 rows" in out.output, out.output
    assert "the reference answers NaN/inf at 2 rows (first: 5) where the engine is finite" in out.output, out.output


def _refuse(token: str) -> None:
    raise ValueError(f"not strict JSON: {token}")


def test_stdout_is_strict_json_on_nan(tmp_path: Path) -> None:
    """The JSON on stdout of an engine that answers NaN holds null for its non-finite figures, as validation.json."""
    engine, inputs = tmp_path / "e", tmp_path / "x.npz"
    assert invoke("build", _graph(tmp_path / "engine.onnx", False), "-o", engine).exit_code == 0
    x = np.abs(np.random.default_rng(1).standard_normal((32, 4))).astype(np.float32)
    x[[5, 9], 2] = -1.0
    np.savez(inputs, input=x)
    out = invoke("validate", engine, "--reference", _graph(tmp_path / "m.onnx", True), "--inputs", inputs)
    assert out.exit_code == 3, out.output
    got, _ = json.JSONDecoder(parse_constant=_refuse).raw_decode(out.output[out.output.index("{") :])
    assert got["max_abs_err"] is None and got["cosine"] is None, got
