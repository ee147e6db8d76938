"""`kiln precision FILE` where ONNX Runtime CPU's dynamically quantized graph quantizes nothing (every MatMul reaches
its weight through a Transpose, as an un-optimized export has it): that graph is not made, said as what calibration
did, not as a variant that failed its gates; the Q/DQ graph is the int8 variant ONNX Runtime CPU engines load."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tests.pipeline.test_faults import invoke


def _no_stored_weight(path: Path) -> Path:
    """x [batch, 16] -> MatMul by Transpose(w1) -> Relu -> MatMul by Transpose(w2) -> logits [batch, 4]: no MatMul
    takes a stored weight."""
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array((0.3 * rng.standard_normal((32, 16))).astype(np.float32), "w1")
    w2 = numpy_helper.from_array((0.3 * rng.standard_normal((4, 32))).astype(np.float32), "w2")
    graph = helper.make_graph(
        [
            helper.make_node("Transpose", ["w1"], ["w1t"], name="transpose_w1"),
            helper.make_node("MatMul", ["x", "w1t"], ["h"], name="hidden"),
            helper.make_node("Relu", ["h"], ["r"], name="relu"),
            helper.make_node("Transpose", ["w2"], ["w2t"], name="transpose_w2"),
            helper.make_node("MatMul", ["r", "w2t"], ["logits"], name="head"),
        ],
        "no_stored_weight",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 4])],
        [w1, w2],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_an_ort_cpu_graph_that_quantized_nothing_is_not_said_to_fail_its_gates(tmp_path: Path) -> None:
    """A graph whose dynamic calibration quantized no compute node is no int8 graph of its own: said so, not said to
    have failed its gates."""
    x = np.random.default_rng(1).standard_normal((128, 16)).astype(np.float32)
    np.savez(tmp_path / "calib.npz", x=x)
    out = invoke(
        "precision", _no_stored_weight(tmp_path / "m.onnx"), "-o", tmp_path / "v", "--variants", "int8",
        "--calibration", tmp_path / "calib.npz",
    )  # fmt: skip
    assert out.exit_code == 0, out.output
    text = " ".join(out.output.split())
    assert "failed its gates" not in text and "no fallback round passed" not in text, text
    assert "int8 (onnxruntime-cpu graph) not made: its dynamic calibration quantized no compute node" in text, text
    assert (tmp_path / "v" / "int8" / "model.onnx").exists()
    assert not (tmp_path / "v" / "int8" / "model.ort_cpu.onnx").exists()
