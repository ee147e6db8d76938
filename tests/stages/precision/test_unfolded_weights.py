"""`kiln precision FILE` on an un-optimized export: its MatMuls reach their weights through a Transpose of a stored
weight, which ONNX Runtime's dynamic quantization does not quantize, so the ONNX Runtime CPU INT8 graph computes
little in int8 while its stored-weight Gemm is quantized. The cause is said with its fix (`kiln optimize` first)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tests.pipeline.test_faults import invoke


def _unfolded(path: Path) -> Path:
    """x [batch, 16] -> MatMul by a transposed stored weight -> ReLU -> Gemm by a stored weight -> logits [batch, 4]:
    most FLOPs in the MatMul, whose weight only constant folding makes a stored one."""
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array((0.3 * rng.standard_normal((32, 16))).astype(np.float32), "w1")
    w2 = numpy_helper.from_array((0.3 * rng.standard_normal((4, 32))).astype(np.float32), "w2")
    graph = helper.make_graph(
        [
            helper.make_node("Transpose", ["w1"], ["w1t"], name="transpose_w1"),
            helper.make_node("MatMul", ["x", "w1t"], ["h"], name="hidden"),
            helper.make_node("Relu", ["h"], ["r"], name="relu"),
            helper.make_node("Gemm", ["r", "w2"], ["logits"], name="head", transB=1),
        ],
        "unfolded",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 4])],
        [w1, w2],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_matmuls_left_in_float_for_unfolded_weights_say_to_optimize_first(tmp_path: Path) -> None:
    x = np.random.default_rng(1).standard_normal((128, 16)).astype(np.float32)
    np.savez(tmp_path / "calib.npz", x=x)
    out = invoke(
        "precision", _unfolded(tmp_path / "m.onnx"), "-o", tmp_path / "v", "--variants", "int8",
        "--calibration", tmp_path / "calib.npz",
    )  # fmt: skip
    assert out.exit_code == 0, out.output
    text = " ".join(out.output.split())
    assert "1 of its 2 MatMul/Gemm layers left in float (hidden) reach" in text, text
    assert "`kiln optimize` the graph first" in text, text
    assert "int8 (onnxruntime-cpu graph) not made" in text, text  # too little of it in INT8: not left on disk
    assert not (tmp_path / "v" / "int8" / "model.ort_cpu.onnx").exists()
