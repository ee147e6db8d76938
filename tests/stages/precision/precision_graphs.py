"""Tiny ONNX graphs built in code for the precision tests (input "input" [batch, F] float, output "logits")."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 18


def make_model(
    nodes: list[onnx.NodeProto],
    inits: dict[str, np.ndarray],
    features: int | str = 16,
    out_dim: int = 10,
    in_type: int = TensorProto.FLOAT,
) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("input", in_type, ["batch", features])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", out_dim])],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    return onnx.shape_inference.infer_shapes(model)


def rng_weights(*shape: int, seed: int = 0, scale: float = 0.3) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def sensitive_graph() -> onnx.ModelProto:
    """MatMul -> LayerNormalization -> MatMul -> Softmax -> Exp -> MatMul(logits)."""
    n = [
        helper.make_node("MatMul", ["input", "w1"], ["h1"], name="mm1"),
        helper.make_node("LayerNormalization", ["h1", "g", "b"], ["ln"], name="ln", axis=-1),
        helper.make_node("MatMul", ["ln", "w2"], ["h2"], name="mm2"),
        helper.make_node("Softmax", ["h2"], ["sm"], name="softmax", axis=-1),
        helper.make_node("Exp", ["sm"], ["ex"], name="exp"),
        helper.make_node("MatMul", ["ex", "w3"], ["logits"], name="mm3"),
    ]
    return make_model(
        n,
        {
            "w1": rng_weights(16, 32),
            "g": np.ones(32, np.float32),
            "b": np.zeros(32, np.float32),
            "w2": rng_weights(32, 32, seed=1),
            "w3": rng_weights(32, 10, seed=2),
        },
    )


def decomposed_layernorm_graph() -> onnx.ModelProto:
    """LayerNorm as ReduceMean/Sub/Pow/ReduceMean/Add/Sqrt/Div/Mul/Add, then a pool-like ReduceMean."""
    axes = np.array([-1], np.int64)
    n = [
        helper.make_node("MatMul", ["input", "w1"], ["h"], name="mm1"),
        helper.make_node("ReduceMean", ["h", "axes"], ["mu"], name="ln_mean"),
        helper.make_node("Sub", ["h", "mu"], ["xc"], name="ln_sub"),
        helper.make_node("Pow", ["xc", "two"], ["sq"], name="ln_pow"),
        helper.make_node("ReduceMean", ["sq", "axes"], ["var"], name="ln_var"),
        helper.make_node("Add", ["var", "eps"], ["ve"], name="ln_eps"),
        helper.make_node("Sqrt", ["ve"], ["sd"], name="ln_sqrt"),
        helper.make_node("Div", ["xc", "sd"], ["nrm"], name="ln_div"),
        helper.make_node("Mul", ["nrm", "gamma"], ["sc"], name="ln_gamma"),
        helper.make_node("Add", ["sc", "beta"], ["ln"], name="ln_beta"),
        helper.make_node("MatMul", ["ln", "w2"], ["logits"], name="mm2"),
    ]
    return make_model(
        n,
        {
            "w1": rng_weights(16, 32),
            "axes": axes,
            "two": np.array(2.0, np.float32),
            "eps": np.array(1e-5, np.float32),
            "gamma": np.ones(32, np.float32),
            "beta": np.zeros(32, np.float32),
            "w2": rng_weights(32, 10, seed=1),
        },
    )


def reduction_graph(length: int, op: str = "ReduceSum") -> onnx.ModelProto:
    """input [batch, 16] -> MatMul to [batch, length] -> ``op`` (a ReduceSum) over the length axis -> logits."""
    n = [
        helper.make_node("MatMul", ["input", "w1"], ["h"], name="mm1"),
        helper.make_node(op, ["h", "axes"], ["s"], name="reduce", keepdims=1),
        helper.make_node("Mul", ["s", "w2"], ["logits"], name="head"),
    ]
    return make_model(
        n, {"w1": rng_weights(16, length), "axes": np.array([1], np.int64), "w2": rng_weights(1, 10, seed=1)}
    )


def chain_graph(scale: float = 1.0, big_weight: float | None = None) -> onnx.ModelProto:
    """MatMul -> Mul(scale) -> Relu -> Div(scale) -> MatMul(logits); ``big_weight`` plants one huge weight."""
    w2 = rng_weights(32, 10, seed=1)
    if big_weight is not None:
        w2 = w2 / big_weight
        w2[0, 0] = big_weight
    n = [
        helper.make_node("MatMul", ["input", "w1"], ["h"], name="mm1"),
        helper.make_node("Mul", ["h", "scale"], ["hs"], name="scale_up"),
        helper.make_node("Relu", ["hs"], ["r"], name="relu"),
        helper.make_node("Div", ["r", "scale"], ["rd"], name="scale_down"),
        helper.make_node("MatMul", ["rd", "w2"], ["logits"], name="head"),
    ]
    return make_model(n, {"w1": rng_weights(16, 32), "scale": np.array(scale, np.float32), "w2": w2})


def reshape_in_range_graph(scale: float) -> onnx.ModelProto:
    """chain_graph with a Reshape where the Relu was: the scaled-up values pass through an op that only moves data."""
    n = [
        helper.make_node("MatMul", ["input", "w1"], ["h"], name="mm1"),
        helper.make_node("Mul", ["h", "scale"], ["hs"], name="scale_up"),
        helper.make_node("Reshape", ["hs", "shape"], ["r"], name="reshape"),
        helper.make_node("Div", ["r", "scale"], ["rd"], name="scale_down"),
        helper.make_node("MatMul", ["rd", "w2"], ["logits"], name="head"),
    ]
    return make_model(
        n,
        {
            "w1": rng_weights(16, 32),
            "scale": np.array(scale, np.float32),
            "shape": np.array([-1, 32], np.int64),
            "w2": rng_weights(32, 10, seed=1),
        },
    )


def plus_minus_big_graph() -> onnx.ModelProto:
    """(h + 4096) - 4096 between two MatMuls: FP16 rounding at the Add loses h's fraction, the Sub shows it."""
    nodes = [
        helper.make_node("MatMul", ["input", "w1"], ["h"], name="mm1"),
        helper.make_node("Add", ["h", "big"], ["hb"], name="add_big"),
        helper.make_node("Sub", ["hb", "big"], ["hs"], name="sub_big"),
        helper.make_node("MatMul", ["hs", "w2"], ["logits"], name="head"),
    ]
    return make_model(
        nodes, {"w1": rng_weights(16, 32), "big": np.array(4096.0, np.float32), "w2": rng_weights(32, 10, seed=1)}
    )


def inputs(n: int = 256, features: int = 16, seed: int = 0, scale: float = 1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((n, features)) * scale).astype(np.float32)


def node_input_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of each node's first input (after shape inference): the precision it computes in."""
    model = onnx.shape_inference.infer_shapes(model)
    types = {v.name: v.type.tensor_type.elem_type for v in [*model.graph.value_info, *model.graph.input]}
    types |= {i.name: i.data_type for i in model.graph.initializer}
    return {n.name: types.get(n.input[0], 0) for n in model.graph.node if n.input}


def token_graph(vocab: int = 10, length: int | str = 6) -> onnx.ModelProto:
    """Token ids ("input" [batch, length] int64; a named ``length``: a dynamic axis) -> an embedding of ``vocab``
    rows -> mean over the tokens -> logits: a graph whose integer input indexes a table
    (:func:`kiln.core.onnx_io.index_ranges`)."""
    nodes = [
        helper.make_node("Gather", ["table", "input"], ["embedded"]),
        helper.make_node("ReduceMean", ["embedded", "axes"], ["pooled"], keepdims=0),
        helper.make_node("MatMul", ["pooled", "w"], ["logits"]),
    ]
    inits = {"table": rng_weights(vocab, 8), "axes": np.array([1], np.int64), "w": rng_weights(8, 10, seed=1)}
    return make_model(nodes, inits, features=length, in_type=TensorProto.INT64)
