"""ORT FP16 engines converted from the FP32 graph (``fp16_source: fp32_graph``) of a model with ONNX sequences: the
sequences, and the Loop and Sequence ops that make and read them, stay FP32, and the graph still loads and agrees
with FP32. ONNX Runtime's converter alone retypes a sequence FP16 and casts it like a tensor (an invalid graph)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from kiln.core.onnx_io import infer_shapes, load_onnx, ort_session
from kiln.stages.engines.onnxruntime.build import build_ort_engine
from kiln.stages.engines.onnxruntime.config import OnnxRuntimeConfig
from kiln.stages.export.torch_export import export_onnx
from kiln.stages.precision.fp16_select import unconvertible_ops
from tests.stages.precision.precision_graphs import make_model, rng_weights
from tests.user_models import BagModel

F32, F16 = TensorProto.FLOAT, TensorProto.FLOAT16
STEPS = 3


def sequence(name: str) -> onnx.ValueInfoProto:
    return helper.make_value_info(name, helper.make_sequence_type_proto(helper.make_tensor_type_proto(F32, None)))


def loop_body() -> onnx.GraphProto:
    """One step: insert ``h * step`` into the carried sequence; ``h`` is read from the outer graph by name."""
    nodes = [
        helper.make_node("Identity", ["cond_in"], ["cond_out"], name="keep_going"),
        helper.make_node("Cast", ["step"], ["step_f"], name="step_float", to=F32),
        helper.make_node("Mul", ["h", "step_f"], ["row"], name="scale"),
        helper.make_node("SequenceInsert", ["seq_in", "row"], ["seq_out"], name="insert"),
    ]
    return helper.make_graph(
        nodes,
        "body",
        [
            helper.make_tensor_value_info("step", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            sequence("seq_in"),
        ],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []), sequence("seq_out")],
    )


def sequence_graph() -> onnx.ModelProto:
    """MatMul -> Loop building a sequence from SequenceEmpty -> ConcatFromSequence -> MatMul: the layout of an
    ``nn.EmbeddingBag`` export, small."""
    nodes = [
        helper.make_node("MatMul", ["input", "w1"], ["h"], name="mm1"),
        helper.make_node("SequenceEmpty", [], ["empty"], name="empty_seq", dtype=F32),
        helper.make_node("Loop", ["steps", "go", "empty"], ["rows"], name="loop", body=loop_body()),
        helper.make_node("ConcatFromSequence", ["rows"], ["cat"], name="concat", axis=1),
        helper.make_node("MatMul", ["cat", "w2"], ["logits"], name="head"),
    ]
    inits = {
        "w1": rng_weights(16, 8),
        "w2": rng_weights(8 * STEPS, 10, seed=1),
        "steps": np.array(STEPS, np.int64),
        "go": np.array(True),
    }
    return make_model(nodes, inits)


def fp16_engine(src: Path, out: Path, precision_kept: bool) -> Path:
    """The FP16 engine graph ORT's converter makes of the FP32 graph ``src``: a CUDA engine built here is the
    converted graph as it is (without a CUDA EP nothing optimizes it offline), which a CPU session can run.
    ``precision_kept``: given the nodes the precision stage keeps FP32 (its sequences and control flow), as a
    run's build is; else none."""
    keep = sorted(unconvertible_ops(infer_shapes(load_onnx(src)))) if precision_kept else None
    out.mkdir()
    build_ort_engine(src, out, "cuda", "fp16", OnnxRuntimeConfig(devices=["cuda"]), keep_fp32=keep, max_batch=8)
    return out / "engine.onnx"


def run(path: Path, x: np.ndarray) -> np.ndarray:
    sess = ort_session(path)
    return sess.run(None, {sess.get_inputs()[0].name: x})[0]


def input_types(model: onnx.ModelProto) -> dict[str, int]:
    """The element type of each main-graph node's first input, by node name."""
    types = {v.name: v.type.tensor_type.elem_type for v in [*model.graph.value_info, *model.graph.input]}
    types |= {i.name: i.data_type for i in model.graph.initializer}
    return {n.name: types.get(n.input[0], 0) for n in model.graph.node if n.input}


@pytest.mark.parametrize("precision_kept", [True, False])
def test_sequences_in_a_loop_stay_fp32_and_the_engine_loads(tmp_path: Path, precision_kept: bool) -> None:
    src = tmp_path / "model.onnx"
    onnx.save(sequence_graph(), str(src))
    engine = fp16_engine(src, tmp_path / "e", precision_kept)  # before: ORT refused it (a Cast on a sequence)
    x = np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32)
    np.testing.assert_allclose(run(engine, x), run(src, x), atol=2e-2, rtol=2e-2)
    model = onnx.shape_inference.infer_shapes(onnx.load(str(engine)))
    nodes = {n.name: n for n in model.graph.node}
    assert helper.get_attribute_value(nodes["empty_seq"].attribute[0]) == F32
    types = input_types(model)
    assert types["mm1"] == types["head"] == F16  # the tensors around the sequences still convert
    assert types["concat"] != F16  # the sequence the Loop made is FP32
    assert not any(n.op_type == "Cast" and n.input[0] in {"empty", "rows"} for n in model.graph.node)


@pytest.mark.parametrize("precision_kept", [True, False])
def test_an_embedding_bag_fp16_engine_loads_and_agrees(tmp_path: Path, precision_kept: bool) -> None:
    torch.manual_seed(0)
    model = BagModel().eval()
    src = tmp_path / "export.onnx"
    export_onnx(model, torch.randint(0, 17, (2, 64)), src)
    engine = fp16_engine(src, tmp_path / "e", precision_kept)  # before: ORT refused the graph
    x = np.random.default_rng(0).integers(0, 17, (8, 64)).astype(np.int64)
    with torch.inference_mode():
        want = model(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(run(engine, x), want, atol=5e-2, rtol=5e-2)
