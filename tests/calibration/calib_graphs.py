"""Tiny graphs built in code for the calibration tests: a Conv -> Relu -> pool -> MatMul -> Gemm classifier, a
routed graph (a masked infinite tensor beside a branch no sample takes) and an x -> y helper."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def conv_model() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    w = lambda *s: (rng.standard_normal(s) * 0.3).astype(np.float32)  # noqa: E731
    nodes = [
        helper.make_node("Conv", ["input", "cw"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("GlobalAveragePool", ["r"], ["p"], name="pool"),
        helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
        helper.make_node("MatMul", ["f", "mw"], ["m"], name="matmul"),
        helper.make_node("Gemm", ["m", "gw", "gb"], ["logits"], name="head", transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 1, 8, 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])],
        [
            numpy_helper.from_array(v, k)
            for k, v in {"cw": w(8, 1, 3, 3), "mw": w(8, 16), "gw": w(10, 16), "gb": w(10)}.items()
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    return onnx.shape_inference.infer_shapes(model)


def batches(n: int = 4, size: int = 16, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.random((size, 1, 8, 8), dtype=np.float32) for _ in range(n)]


def saved(tmp: Path) -> Path:
    p = tmp / "model.onnx"
    onnx.save(conv_model(), p)
    return p


def save_x_to_y(path: Path, nodes: list[onnx.NodeProto], inits: list[onnx.TensorProto], shape: list) -> Path:
    """A graph of ``nodes`` from float input "x" of ``shape`` to float output "y" (its shape left to inference),
    saved at ``path`` (opset 17)."""
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def routed_onnx(path: Path) -> Path:
    """x [batch, 4] -> MatMul -> logits; Where(mask, logits, -inf) -> y (infinite where masked); the rows whose
    largest value passes 1e6 (none of the data's) -> Compress -> routed -> MatMul -> expert -> z: an MoE expert that
    no token is sent to."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["logits"], name="matmul"),
        helper.make_node("Where", ["mask", "logits", "fill"], ["y"], name="mask"),
        helper.make_node("ReduceMax", ["x", "axes"], ["rowmax"], name="rowmax", keepdims=0),
        helper.make_node("Greater", ["rowmax", "limit"], ["routes"], name="route"),
        helper.make_node("Compress", ["logits", "routes"], ["routed"], name="gather_rows", axis=0),
        helper.make_node("MatMul", ["routed", "w2"], ["expert"], name="expert"),
        helper.make_node("Relu", ["expert"], ["z"], name="expert_act"),
    ]
    graph = helper.make_graph(
        nodes,
        "routed",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4]),
            helper.make_tensor_value_info("mask", TensorProto.BOOL, ["batch", 3]),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3]),
            helper.make_tensor_value_info("z", TensorProto.FLOAT, ["rows", 3]),
        ],
        [
            numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "w"),
            numpy_helper.from_array(rng.standard_normal((3, 3)).astype(np.float32), "w2"),
            numpy_helper.from_array(np.array(-np.inf, np.float32), "fill"),
            numpy_helper.from_array(np.array([1], np.int64), "axes"),
            numpy_helper.from_array(np.array(1e6, np.float32), "limit"),
        ],
    )
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(path))
    return path


def routed_batches(n: int = 3) -> list[dict[str, np.ndarray]]:
    """``n`` batches of 16 rows, about a third of the actions masked (``y`` infinite there), every row with one legal
    action at least; no row routed to :func:`routed_onnx`'s expert."""
    rng = np.random.default_rng(1)
    out = []
    for _ in range(n):
        mask = rng.random((16, 3)) < 0.67
        mask[np.arange(16), rng.integers(0, 3, 16)] = True
        out.append({"x": rng.standard_normal((16, 4)).astype(np.float32), "mask": mask})
    return out
