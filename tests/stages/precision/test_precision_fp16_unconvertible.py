"""FP16 on graphs onnxconverter-common mishandles: float-list Constants, control flow and sequences (an
``nn.EmbeddingBag`` export has all three). The graph must stay valid; what cannot convert stays FP32, reported."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from kiln.core.onnx_io import check_onnx, infer_shapes, load_onnx
from kiln.stages.export.torch_export import export_onnx
from kiln.stages.precision import fp16 as fp16_module
from kiln.stages.precision.compare import run_batched
from kiln.stages.precision.config import FP16Config
from kiln.stages.precision.fp16 import convert_fp16, name_nodes
from kiln.stages.precision.fp16_select import select_fp32_nodes
from tests.stages.precision.precision_graphs import inputs, make_model, node_input_types, rng_weights
from tests.user_models import BagModel

F32, F16 = TensorProto.FLOAT, TensorProto.FLOAT16


def value_floats_graph() -> onnx.ModelProto:
    """MatMul -> Add(Constant(value_floats=[...])) -> MatMul: the bias is a float-list Constant attribute."""
    bias = [float(v) for v in np.linspace(-1, 1, 32)]
    nodes = [
        helper.make_node("MatMul", ["input", "w1"], ["h"], name="mm1"),
        helper.make_node("Constant", [], ["bias"], name="bias_const", value_floats=bias),
        helper.make_node("Add", ["h", "bias"], ["hb"], name="add_bias"),
        helper.make_node("MatMul", ["hb", "w2"], ["logits"], name="head"),
    ]
    return make_model(nodes, {"w1": rng_weights(16, 32), "w2": rng_weights(32, 10, seed=1)})


def test_value_floats_constant_converts_to_a_valid_graph() -> None:
    model = value_floats_graph()
    converted, info = convert_fp16(model, set(), FP16Config())
    check_onnx(converted)  # the old converter output failed here: FP16 output type, FP32 value
    assert info["unconvertible"] == {}
    assert node_input_types(converted)["add_bias"] == F16
    x = inputs(64)
    np.testing.assert_allclose(run_batched(converted, x)[0], run_batched(model, x)[0], atol=2e-2, rtol=2e-2)


def test_a_node_the_converter_breaks_stays_fp32_and_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    # Without the Constant rewrite the converter breaks 'bias_const': the safety net must keep it FP32.
    monkeypatch.setattr(fp16_module, "constants_as_tensors", lambda graph: 0)
    model = value_floats_graph()
    converted, info = convert_fp16(model, set(), FP16Config())
    check_onnx(converted)
    assert list(info["unconvertible"]) == ["bias_const"]
    assert "invalid graph" in info["unconvertible"]["bias_const"]
    types = node_input_types(converted)
    assert types["mm1"] == types["head"] == F16  # the rest of the graph still converts


@pytest.fixture(scope="module")
def bag_onnx(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bag") / "model.onnx"
    torch.manual_seed(0)
    export_onnx(BagModel(), torch.randint(0, 17, (2, 64)), path)
    return path


def test_embedding_bag_fp16_is_valid_and_keeps_control_flow_fp32(bag_onnx: Path) -> None:
    model = name_nodes(infer_shapes(load_onnx(bag_onnx)))
    ops = {n.op_type for n in model.graph.node}
    assert {"Loop", "SequenceEmpty"} <= ops  # what the dynamo exporter writes for EmbeddingBag today
    keep = select_fp32_nodes(model, FP16Config())
    assert any("control flow" in why for why in keep.values()) and any("sequences" in w for w in keep.values())
    converted, _ = convert_fp16(model, set(keep), FP16Config())
    check_onnx(converted)
    x = np.random.default_rng(0).integers(0, 17, (32, 64)).astype(np.int64)
    np.testing.assert_allclose(run_batched(converted, x)[0], run_batched(model, x)[0], atol=5e-2, rtol=5e-2)
    assert node_input_types(converted)["node_linear"] == F16  # the head still runs in FP16


def test_a_node_that_stays_invalid_in_fp32_ends_in_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from kiln.core.errors import ModelError

    def always_refused(model, what):  # the checker keeps naming the same node, whatever its precision
        onnx.checker.check_model(model)
        raise ModelError(
            f"{what} fails the ONNX checker: (op_type:Add, node name: add_bias): planted",
            hint="re-export with a supported opset",
        )

    monkeypatch.setattr(fp16_module, "check_onnx", always_refused)
    with pytest.raises(ModelError, match="node name: add_bias") as err:
        convert_fp16(value_floats_graph(), set(), FP16Config())
    assert "precision.fp16.fp32_nodes" in err.value.hint and "re-export" not in err.value.hint


def if_graph() -> onnx.ModelProto:
    """h = input @ w; If(sum(input) > 0) then h + input else h - input: both branches read h and the graph
    input from the outer scope by name, not through the If's inputs."""

    def branch(op: str, name: str) -> onnx.GraphProto:
        return helper.make_graph(
            [helper.make_node(op, ["h", "input"], [f"{name}_out"], name=f"{name}_op")],
            name,
            [],
            [helper.make_tensor_value_info(f"{name}_out", F32, None)],
        )

    nodes = [
        helper.make_node("MatMul", ["input", "w"], ["h"], name="mm"),
        helper.make_node("ReduceSum", ["input"], ["s"], name="sum", keepdims=0),
        helper.make_node("Greater", ["s", "zero"], ["cond"], name="gt"),
        helper.make_node(
            "If", ["cond"], ["y"], name="branch", then_branch=branch("Add", "then"), else_branch=branch("Sub", "else")
        ),
        helper.make_node("MatMul", ["y", "w2"], ["logits"], name="head"),
    ]
    return make_model(
        nodes, {"w": rng_weights(16, 16), "zero": np.array(0, np.float32), "w2": rng_weights(16, 10, seed=1)}
    )


def test_control_flow_stays_fp32_and_reads_fp32_outer_tensors() -> None:
    model = if_graph()
    keep = select_fp32_nodes(model, FP16Config())
    assert "control flow" in keep["branch"]
    converted, _ = convert_fp16(model, set(keep), FP16Config())
    check_onnx(converted)  # before: the converter's casts broke the graph's order / the branch mixed FP16 and FP32
    types = node_input_types(converted)
    assert types["mm"] == types["head"] == F16
    x = inputs(64)
    np.testing.assert_allclose(run_batched(converted, x)[0], run_batched(model, x)[0], atol=2e-2, rtol=2e-2)


def test_a_graph_the_converter_refuses_is_a_model_error() -> None:
    # A float16 weight makes onnxconverter-common raise a plain ValueError ("already converted"): the stage only
    # isolates a failing variant when the failure is a KilnError, so it must become one. (A float16 input, an FP32
    # model's half-precision features, converts: test_direct_random.py.)
    from kiln.core.errors import ModelError

    nodes = [
        helper.make_node("Cast", ["w"], ["w32"], to=F32, name="to32"),
        helper.make_node("MatMul", ["input", "w32"], ["logits"], name="mm"),
    ]
    model = make_model(nodes, {"w": rng_weights(16, 10).astype(np.float16)})
    with pytest.raises(ModelError, match="already converted") as err:
        convert_fp16(model, set(), FP16Config())
    assert "other variants are still built" in err.value.hint and "\n" not in err.value.message


def test_any_node_reading_or_writing_a_sequence_stays_fp32() -> None:
    # An Identity passing a sequence on is no Sequence op, yet a converter retyping or casting its output breaks it
    nodes = [
        helper.make_node("MatMul", ["input", "w"], ["h"], name="mm"),
        helper.make_node("SequenceConstruct", ["h", "h"], ["pair"], name="construct"),
        helper.make_node("Identity", ["pair"], ["pair_again"], name="pass_on"),
        helper.make_node("ConcatFromSequence", ["pair_again"], ["logits"], name="concat", axis=1),
    ]
    model = make_model(nodes, {"w": rng_weights(16, 5)})
    keep = select_fp32_nodes(model, FP16Config())
    assert {"construct", "pass_on", "concat"} <= set(keep) and "mm" not in keep
    assert "sequences" in keep["pass_on"]
    converted, _ = convert_fp16(model, set(keep), FP16Config())
    check_onnx(converted)
    assert node_input_types(converted)["mm"] == F16
