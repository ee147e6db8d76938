"""`kiln validate ENGINE --reference ...`'s JSON says what its gates judged: headline values over the outputs
``validate.gates.gated_outputs`` lists, as the stage's are, and the kind of agreement only beside one measured."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tests.pipeline.test_faults import invoke

RNG = np.random.default_rng(0)
W = RNG.standard_normal((4, 3)).astype(np.float32)  # the class logits' weights
V = RNG.standard_normal((4, 8)).astype(np.float32)  # a hidden state's


def _two_outputs(path: Path, v: np.ndarray, first: str = "logits") -> Path:
    """input [batch, 4] -> ``first`` [batch, 3] = input @ W and hidden [batch, 8] = input @ ``v``."""
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["input", "w"], [first]),
            helper.make_node("MatMul", ["input", "v"], ["hidden"]),
        ],
        "two_outputs",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 4])],
        [
            helper.make_tensor_value_info(first, TensorProto.FLOAT, ["batch", 3]),
            helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["batch", 8]),
        ],
        [numpy_helper.from_array(W, "w"), numpy_helper.from_array(v, "v")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    return path


def _validated(tmp_path: Path, first: str, *sets: str) -> dict[str, Any]:
    """The JSON of an engine whose hidden state is off (cosine about 0.9) and ``first`` output exact, against its
    reference, with each ``--set`` of ``sets``."""
    engine, inputs = tmp_path / "e", tmp_path / "x.npz"
    off = V + 0.5 * RNG.standard_normal(V.shape).astype(np.float32)
    assert invoke("build", _two_outputs(tmp_path / "engine.onnx", off, first), "-o", engine).exit_code == 0
    np.savez(inputs, input=np.random.default_rng(1).standard_normal((32, 4)).astype(np.float32))
    model = _two_outputs(tmp_path / "m.onnx", V, first)
    out = invoke("validate", engine, "--reference", model, "--inputs", inputs, *(a for s in sets for a in ("--set", s)))
    return json.loads(out.output[out.output.index("{") :])


def test_the_headline_is_over_the_gated_outputs_only(tmp_path: Path) -> None:
    """With only the (named) logits gated the engine passes, and its headline cosine and errors are the logits',
    not the ungated hidden state's, which keeps its own figures in the per-output statistics."""
    got = _validated(tmp_path, "logits", "validate.gates.gated_outputs=[logits]", "signature.logits_output=logits")
    assert got["passed"], got["failures"]
    logits, hidden = got["outputs"]["logits"], got["outputs"]["hidden"]
    assert hidden["cosine"] < 0.99 and logits["cosine"] > 0.9999
    assert got["cosine"] == logits["cosine"] and got["max_abs_err"] == logits["max_abs_err"], got
    assert got["top1_agreement"] == 1.0 and got["agreement"] == "top1"


def test_no_kind_of_agreement_is_claimed_where_none_was_measured(tmp_path: Path) -> None:
    """Two outputs, none named in ``signature.logits_output``: no top-1 agreement in the JSON, and no
    ``agreement`` saying what it counts."""
    got = _validated(tmp_path, "scores", "validate.gates.gated_outputs=[scores]")
    assert got["passed"], got["failures"]
    assert "top1_agreement" not in got and "agreement" not in got, got
