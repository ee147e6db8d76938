"""FP16 conversion when a graph output is also read inside the graph: the output keeps its FP32 type, the
readers inside keep FP16, the graph is valid, and no no-op Cast survives."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kiln.core.onnx_io import infer_shapes
from kiln.stages.precision.casts import remove_cast_chains
from kiln.stages.precision.compare import run_batched
from kiln.stages.precision.config import FP16Config
from kiln.stages.precision.fp16 import convert_fp16, name_nodes
from tests.stages.precision.precision_graphs import rng_weights

F32, F16 = TensorProto.FLOAT, TensorProto.FLOAT16


def _model(nodes: list[onnx.NodeProto], outputs: list[str], inits: dict[str, np.ndarray]) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("input", F32, ["batch", 16])],
        [helper.make_tensor_value_info(o, F32, None) for o in outputs],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    return name_nodes(infer_shapes(model))


def _noop_casts(model: onnx.ModelProto) -> list[str]:
    types = {
        v.name: v.type.tensor_type.elem_type for v in [*model.graph.value_info, *model.graph.input, *model.graph.output]
    }
    return [n.name for n in model.graph.node if n.op_type == "Cast" and types.get(n.input[0]) == n.attribute[0].i]


def test_fp32_output_that_also_feeds_fp16_nodes() -> None:
    model = _model(
        [
            helper.make_node("MatMul", ["input", "w"], ["h"], name="mm"),
            helper.make_node("Softmax", ["h"], ["probs"], name="sm", axis=-1),
            helper.make_node("MatMul", ["probs", "w2"], ["logits"], name="mm2"),
        ],
        ["probs", "logits"],
        {"w": rng_weights(16, 10), "w2": rng_weights(10, 10, seed=1)},
    )
    converted, _ = convert_fp16(model, {"sm"}, FP16Config())  # raised ModelError (mm2 read FP32) before
    onnx.checker.check_model(converted, full_check=True)
    assert [o.type.tensor_type.elem_type for o in converted.graph.output] == [F32, F32]
    assert _noop_casts(converted) == []
    x = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
    for got, ref in zip(run_batched(converted, x), run_batched(model, x)):
        np.testing.assert_allclose(got, ref, atol=2e-2, rtol=2e-2)


def test_noop_cast_into_output_whose_source_has_other_readers() -> None:
    model = _model(
        [
            helper.make_node("Relu", ["input"], ["r"], name="relu"),
            helper.make_node("Cast", ["r"], ["y"], to=F32, name="noop"),
            helper.make_node("Sigmoid", ["r"], ["z"], name="sig"),
        ],
        ["y", "z"],
        {},
    )
    cleaned, removed = remove_cast_chains(model)
    assert removed == 1 and [n.op_type for n in cleaned.graph.node] == ["Relu", "Sigmoid"]
    onnx.checker.check_model(cleaned, full_check=True)


def test_noop_cast_between_two_graph_outputs_is_kept() -> None:
    model = _model(
        [
            helper.make_node("Relu", ["input"], ["r"], name="relu"),
            helper.make_node("Cast", ["r"], ["y"], to=F32, name="noop"),
        ],
        ["r", "y"],
        {},
    )
    cleaned, _ = remove_cast_chains(model)
    onnx.checker.check_model(cleaned, full_check=True)
    assert [o.name for o in cleaned.graph.output] == ["r", "y"]
    x = np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32)
    got = run_batched(cleaned, x)
    np.testing.assert_array_equal(got[0], got[1])


def _close(converted: onnx.ModelProto, model: onnx.ModelProto) -> None:
    onnx.checker.check_model(converted, full_check=True)
    x = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
    for got, ref in zip(run_batched(converted, x), run_batched(model, x)):
        np.testing.assert_allclose(got, ref, atol=2e-2, rtol=2e-2)


def test_fp16_output_that_also_feeds_fp16_nodes() -> None:
    """Like the Softmax case but the output's producer is FP16 (a Relu): its FP16 readers must read the FP16
    tensor, not the FP32 copy the converter casts for the output (that was a type clash: ModelError)."""
    model = _model(
        [
            helper.make_node("MatMul", ["input", "w"], ["h"], name="mm"),
            helper.make_node("Relu", ["h"], ["logits"], name="relu"),
            helper.make_node("Mul", ["logits", "two"], ["extra"], name="mul2"),
        ],
        ["logits", "extra"],
        {"w": rng_weights(16, 10), "two": np.array(2, np.float32)},
    )
    converted, _ = convert_fp16(model, set(), FP16Config())
    assert [o.type.tensor_type.elem_type for o in converted.graph.output] == [F32, F32]
    _close(converted, model)


def test_cast_to_float_from_a_mask() -> None:
    """mask = (x > 0).float(): the converter typed the Cast's output FP16 and kept to=FLOAT (an invalid graph;
    the error blamed the opset). One Cast bool -> FP16 remains."""
    model = _model(
        [
            helper.make_node("Greater", ["input", "zero"], ["gt"], name="gt"),
            helper.make_node("Cast", ["gt"], ["mask"], name="cast_mask", to=F32),
            helper.make_node("Mul", ["input", "mask"], ["xm"], name="mul"),
            helper.make_node("MatMul", ["xm", "w"], ["logits"], name="mm"),
        ],
        ["logits"],
        {"zero": np.array(0, np.float32), "w": rng_weights(16, 10)},
    )
    converted, _ = convert_fp16(model, set(), FP16Config())
    from_mask = [n.attribute[0].i for n in converted.graph.node if n.op_type == "Cast" and n.input[0] == "gt"]
    assert from_mask == [F16]
    _close(converted, model)
