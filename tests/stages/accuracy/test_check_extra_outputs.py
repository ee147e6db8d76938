"""An engine output the reference lacks is refused, as one the engine lacks is: compared against a reference of
fewer outputs, an engine would pass with an output it serves never checked."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.core.errors import ModelError
from kiln.stages.accuracy.check import compare_all
from tests.pipeline.test_faults import assert_clean, invoke

W = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)


def _argmax(path: Path, logits_out: bool) -> Path:
    """input [batch, 4] -> pred int64 [batch] (the argmax of input @ W), beside logits [batch, 3] if ``logits_out``."""
    outputs = [helper.make_tensor_value_info("pred", TensorProto.INT64, ["batch"])]
    if logits_out:
        outputs.insert(0, helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 3]))
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["input", "w"], ["logits"]),
            helper.make_node("ArgMax", ["logits"], ["pred"], axis=1, keepdims=0),
        ],
        "argmax",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 4])],
        outputs,
        [numpy_helper.from_array(W, "w")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_an_output_the_reference_lacks_is_refused() -> None:
    ref = {"pred": np.zeros(4, np.int64)}
    got = {**ref, "logits": np.zeros((4, 3), np.float32)}
    with pytest.raises(ModelError, match=r"the reference has no output \['logits'\] that the engine serves"):
        compare_all(ref, got, None)


def test_validate_refuses_a_reference_without_an_output_the_engine_serves(tmp_path: Path) -> None:
    engine, inputs = tmp_path / "e", tmp_path / "x.npz"
    assert invoke("build", _argmax(tmp_path / "both.onnx", True), "-o", engine).exit_code == 0
    np.savez(inputs, input=np.random.default_rng(1).standard_normal((32, 4)).astype(np.float32))
    out = invoke("validate", engine, "--reference", _argmax(tmp_path / "pred.onnx", False), "--inputs", inputs)
    assert_clean(out, 2, "the reference has no output ['logits'] that the engine serves")
