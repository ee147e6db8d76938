"""`kiln precision FILE` of a graph in which calibration quantizes nothing (its compute in Einsum nodes, which no
int8 quantizer of ONNX Runtime computes in int8, its one Gemm the head kept in float by
calibration.keep_output_layers): int8 is not made, and its fix says what keeps the graph float, not to loosen
gates that no graph of int8 was judged by."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tests.pipeline.test_faults import invoke


def _einsum_trees(path: Path) -> Path:
    """x [batch, 4] -> Einsum by e -> Gemm head -> Sigmoid -> proba [batch, 1]."""
    rng = np.random.default_rng(0)
    e = numpy_helper.from_array(rng.standard_normal((4, 8)).astype(np.float32), "e")
    w = numpy_helper.from_array(rng.standard_normal((1, 8)).astype(np.float32), "w")
    graph = helper.make_graph(
        [
            helper.make_node("Einsum", ["x", "e"], ["h"], equation="bi,ij->bj", name="trees"),
            helper.make_node("Gemm", ["h", "w"], ["logit"], transB=1, name="head"),
            helper.make_node("Sigmoid", ["logit"], ["proba"], name="sigmoid"),
        ],
        "einsum_trees",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("proba", TensorProto.FLOAT, ["batch", 1])],
        [e, w],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_int8_that_quantized_nothing_gets_its_own_fix(tmp_path: Path) -> None:
    np.savez(tmp_path / "calib.npz", x=np.random.default_rng(1).standard_normal((64, 4)).astype(np.float32))
    out = invoke(
        "precision", _einsum_trees(tmp_path / "m.onnx"), "-o", tmp_path / "v", "--variants", "int8",
        "--calibration", tmp_path / "calib.npz",
    )  # fmt: skip
    text = " ".join(out.output.split())
    assert out.exit_code == 2, text
    assert "calibration quantized no compute node to int8" in text, text
    fix = text[text.index("fix:") :]
    assert "calibration.keep_output_layers: off" in fix and "precision.fallback.max_rounds" not in fix, fix
