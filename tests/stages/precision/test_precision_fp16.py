"""FP16 mixed precision: which nodes stay FP32, that the graph stays valid, and that casts never chain."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from kiln.calibration.ranges import calibrate
from kiln.stages.precision.casts import cast_chains, remove_cast_chains
from kiln.stages.precision.compare import run_batched
from kiln.stages.precision.config import FP16Config
from kiln.stages.precision.emulate import emulate_fp16
from kiln.stages.precision.fp16 import convert_fp16
from kiln.stages.precision.fp16_select import decomposed_layernorm_nodes, select_fp32_nodes
from tests.stages.precision.precision_graphs import (
    chain_graph,
    decomposed_layernorm_graph,
    inputs,
    make_model,
    node_input_types,
    plus_minus_big_graph,
    reduction_graph,
    reshape_in_range_graph,
    rng_weights,
    sensitive_graph,
)

F32, F16 = TensorProto.FLOAT, TensorProto.FLOAT16


def _convert(model: onnx.ModelProto, cfg: FP16Config | None = None, amax: dict | None = None):
    cfg = cfg or FP16Config()
    keep = select_fp32_nodes(model, cfg, amax)
    converted, info = convert_fp16(model, set(keep), cfg)
    return keep, converted, info


def test_sensitive_ops_stay_fp32_and_the_rest_becomes_fp16() -> None:
    model = sensitive_graph()
    keep, converted, _ = _convert(model)
    assert set(keep) == {"ln", "softmax", "exp"}
    assert "precision-sensitive" in keep["ln"]
    types = node_input_types(converted)
    assert types["ln"] == types["softmax"] == types["exp"] == F32
    assert types["mm1"] == types["mm2"] == types["mm3"] == F16
    # I/O keep their types, and the graph computes nearly the FP32 function
    assert converted.graph.input[0].type.tensor_type.elem_type == F32
    assert converted.graph.output[0].type.tensor_type.elem_type == F32
    x = inputs(64)
    np.testing.assert_allclose(run_batched(converted, x)[0], run_batched(model, x)[0], atol=2e-2, rtol=2e-2)


def test_decomposed_layernorm_found_and_kept() -> None:
    model = decomposed_layernorm_graph()
    found = set(decomposed_layernorm_nodes(model))
    assert found == {"ln_mean", "ln_sub", "ln_pow", "ln_var", "ln_eps", "ln_sqrt", "ln_div", "ln_gamma", "ln_beta"}
    keep, converted, _ = _convert(model)
    assert found <= set(keep)
    types = node_input_types(converted)
    assert types["ln_var"] == F32 and types["mm1"] == F16


@pytest.mark.parametrize("op", ["ReduceMax", "ReduceMin"])
def test_a_long_max_or_min_is_converted(op: str) -> None:
    """A max accumulates nothing: in FP16 it is the FP32 result rounded (PointNet's global max-pool over its points
    was kept in FP32, with casts around it, as a long sum would be)."""
    assert "reduce" not in select_fp32_nodes(reduction_graph(4096, op), FP16Config(long_reduction=1024))


def test_plain_reducemean_is_not_mistaken_for_layernorm() -> None:
    model = reduction_graph(8)
    assert decomposed_layernorm_nodes(model) == []


@pytest.mark.parametrize("length,kept", [(8, False), (4096, True)])
def test_long_reductions_stay_fp32(length: int, kept: bool) -> None:
    keep = select_fp32_nodes(reduction_graph(length), FP16Config(long_reduction=1024))
    assert ("reduce" in keep) is kept
    if kept:
        assert "4096 elements" in keep["reduce"]


def test_weight_out_of_fp16_range_stays_fp32_and_is_not_clamped() -> None:
    model = chain_graph(big_weight=1e6)
    keep, converted, _ = _convert(model)
    assert "head" in keep and "1e+06" in keep["head"]
    x = inputs(64)
    ref, got = run_batched(model, x)[0], run_batched(converted, x)[0]
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, rtol=2e-2, atol=2e-2 * np.abs(ref).max())


def test_activation_out_of_fp16_range_stays_fp32(tmp_path: Path) -> None:
    """scale_up makes activations ~1e5 (FP16 max is 65504): the nodes making and reading them stay FP32."""
    model = chain_graph(scale=3e4)
    x = inputs(128)
    onnx.save(model, tmp_path / "m.onnx")
    amax = calibrate(tmp_path / "m.onnx", [x[:64], x[64:]], "input", "minmax", cache_dir=None).amax()
    assert amax["hs"] > 65504 and amax["h"] < 100
    keep, converted, _ = _convert(model, amax=amax)
    assert set(keep) == {"scale_up", "relu", "scale_down"} and "activation 'hs'" in keep["scale_up"]
    got = run_batched(converted, x)[0]
    assert np.isfinite(got).all()
    assert np.isfinite(run_batched(emulate_fp16(model, set(keep)), x)[0]).all()
    # without the range check the same graph overflows in FP16: the check is what saves it
    keep, unchecked, _ = _convert(model, FP16Config(range_check=False), amax)
    assert node_input_types(unchecked)["scale_up"] == F16
    assert not np.isfinite(run_batched(emulate_fp16(model, set(keep)), x)[0]).all()


def test_out_of_range_values_stay_fp32_through_a_reshape(tmp_path: Path) -> None:
    """A Reshape between the nodes that make and read a ~1e5 tensor must stay FP32 too: in FP16 it overflows."""
    model = reshape_in_range_graph(scale=3e4)
    x = inputs(128)
    onnx.save(model, tmp_path / "m.onnx")
    amax = calibrate(tmp_path / "m.onnx", [x], "input", "minmax", cache_dir=None).amax()
    keep, converted, _ = _convert(model, amax=amax)
    assert {"scale_up", "reshape", "scale_down"} <= set(keep)
    assert node_input_types(converted)["reshape"] == F32
    got, ref = run_batched(converted, x)[0], run_batched(model, x)[0]
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, rtol=2e-2, atol=2e-2 * np.abs(ref).max())


def test_no_cast_chains_with_neighbouring_fp32_islands_and_blocked_output() -> None:
    """Adjacent FP32 nodes, an FP32 node reading the graph input, and one writing the graph output: the
    converter's raw output would chain casts / retype the output; Kiln's graph has neither."""
    model = chain_graph()
    cfg = FP16Config(fp32_nodes=["mm1", "scale_up", "head"])
    keep, converted, info = _convert(model, cfg)
    assert cast_chains(converted) == []
    assert converted.graph.output[0].type.tensor_type.elem_type == F32
    onnx.checker.check_model(converted, full_check=True)
    types = node_input_types(converted)
    assert types["relu"] == F16 and types["head"] == F32


def test_shared_initializer_between_fp32_and_fp16_nodes() -> None:
    """'scale' is read by scale_up (kept FP32) and scale_down (FP16): each gets its own typed copy."""
    model = chain_graph(scale=2.0)
    _, converted, info = _convert(model, FP16Config(fp32_nodes=["scale_up"]))
    assert info["shared_initializers_split"] == 1
    onnx.checker.check_model(converted, full_check=True)
    x = inputs(32)
    np.testing.assert_allclose(run_batched(converted, x)[0], run_batched(model, x)[0], atol=2e-2, rtol=2e-2)


def test_remove_cast_chains_collapses_pairs_and_noops() -> None:
    nodes = [
        helper.make_node("Cast", ["input"], ["a"], to=F16, name="c1"),
        helper.make_node("Cast", ["a"], ["b"], to=F32, name="c2"),  # round trip: drop both
        helper.make_node("MatMul", ["b", "w"], ["m"], name="mm"),
        helper.make_node("Cast", ["m"], ["m32"], to=F32, name="noop"),  # cast to its own type
        helper.make_node("Cast", ["m32"], ["h"], to=F16, name="c3"),
        helper.make_node("Cast", ["h"], ["logits"], to=F32, name="c4"),  # chain into the graph output
    ]
    model = make_model(nodes, {"w": rng_weights(16, 10)})
    assert len(cast_chains(model)) == 3
    cleaned, removed = remove_cast_chains(model)
    assert cast_chains(cleaned) == [] and removed >= 3
    assert [n.op_type for n in cleaned.graph.node] == ["MatMul"]
    onnx.checker.check_model(cleaned, full_check=True)
    x = inputs(8)
    np.testing.assert_allclose(run_batched(cleaned, x)[0], run_batched(model, x)[0], atol=1e-2)


def test_int_inputs_keep_their_type() -> None:
    nodes = [
        helper.make_node("Gather", ["emb", "input"], ["e"], name="gather", axis=0),
        helper.make_node("ReduceMean", ["e", "axes"], ["logits"], name="pool", keepdims=0),
    ]
    model = make_model(nodes, {"emb": rng_weights(17, 10), "axes": np.array([1], np.int64)}, in_type=TensorProto.INT64)
    _, converted, _ = _convert(model)
    assert converted.graph.input[0].type.tensor_type.elem_type == TensorProto.INT64
    ids = np.random.default_rng(0).integers(0, 17, (8, 16))
    np.testing.assert_allclose(run_batched(converted, ids)[0], run_batched(model, ids)[0], atol=1e-2)


def test_emulation_rounds_what_fp16_stores() -> None:
    """ORT's CPU provider computes most FP16 nodes in FP32 and hides FP16 rounding; the emulation shows it:
    (h + 4096) - 4096 loses h's fraction in FP16 unless those two nodes stay FP32."""
    model = plus_minus_big_graph()
    x = inputs(64)
    ref = run_batched(model, x)[0]
    lossy = run_batched(emulate_fp16(model, set()), x)[0]
    kept = run_batched(emulate_fp16(model, {"add_big", "sub_big"}), x)[0]
    assert np.abs(lossy - ref).max() > 0.5
    assert np.abs(kept - ref).max() < 0.05


def test_emulation_and_conversion_of_multi_output_nodes() -> None:
    """A Split (as the QKV merge pass makes) has several float outputs: each is rounded, the node kept once."""
    nodes = [
        helper.make_node("MatMul", ["input", "w1"], ["h"], name="mm1"),
        helper.make_node("Split", ["h", "sizes"], ["a", "b"], name="split", axis=1),
        helper.make_node("Add", ["a", "b"], ["s"], name="add"),
        helper.make_node("MatMul", ["s", "w2"], ["logits"], name="head"),
    ]
    model = make_model(
        nodes, {"w1": rng_weights(16, 32), "sizes": np.array([16, 16], np.int64), "w2": rng_weights(16, 10, seed=1)}
    )
    emulated = emulate_fp16(model, set())
    onnx.checker.check_model(emulated, full_check=True)
    assert sum(n.name == "split" for n in emulated.graph.node) == 1
    x = inputs(32)
    np.testing.assert_allclose(run_batched(emulated, x)[0], run_batched(model, x)[0], atol=2e-2, rtol=2e-2)
    _, converted, _ = _convert(model)
    assert node_input_types(converted)["add"] == F16


def test_a_models_own_float_to_int_cast_behind_a_kept_node_converts() -> None:
    """BART's ``new_zeros``: ConstantOfShape (float zeros: it does not convert, so it stays FP32) cast to INT64 by
    the model. The converter puts an FP16 cast in front of the model's cast; that pair collapses back into the
    model's own cast, where it once ended the variant with "still has Cast chains"."""
    nodes = [
        helper.make_node("Shape", ["input"], ["s"], name="shape"),
        helper.make_node("ConstantOfShape", ["s"], ["z"], name="zeros"),
        helper.make_node("Cast", ["z"], ["zi"], to=TensorProto.INT64, name="new_zeros"),
        helper.make_node("Cast", ["zi"], ["zf"], to=F32, name="back"),
        helper.make_node("Add", ["input", "zf"], ["logits"], name="add"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("input", F32, ["batch", 4])],
        [helper.make_tensor_value_info("logits", F32, ["batch", 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    converted, _ = convert_fp16(model, set(), FP16Config())
    assert cast_chains(converted) == []
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    np.testing.assert_allclose(run_batched(converted, x)[0], x, atol=1e-2)


def test_a_spatial_transformers_sampling_stays_fp32() -> None:
    """AffineGrid's grid and GridSample's read of it: coordinates in [-1, 1] move by 2**-11 in FP16."""
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["theta_flat"], name="loc"),
        helper.make_node("Reshape", ["theta_flat", "theta_shape"], ["theta"], name="theta"),
        helper.make_node("AffineGrid", ["theta", "size"], ["grid"], name="affine_grid"),
        helper.make_node("GridSample", ["image", "grid"], ["y"], name="grid_sample"),
    ]
    rng = np.random.default_rng(0)
    inits = [
        onnx.numpy_helper.from_array(rng.standard_normal((16, 6)).astype(np.float32) * 0.01, "w"),
        onnx.numpy_helper.from_array(np.array([-1, 2, 3], np.int64), "theta_shape"),
        onnx.numpy_helper.from_array(np.array([1, 1, 8, 8], np.int64), "size"),
    ]
    graph = helper.make_graph(
        nodes,
        "stn",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16]),
            helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, 1, 8, 8]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 8, 8])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    keep, converted, _ = _convert(model)
    assert {"affine_grid", "grid_sample"} <= set(keep)
    types = node_input_types(converted)
    assert types["affine_grid"] == types["grid_sample"] == F32 and types["loc"] == F16
