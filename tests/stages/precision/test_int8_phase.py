"""INT8 keeps a rotary embedding's phase (``inv_freq @ positions``, then Cos) in float, as FP16 does: quantized, the
phase of positions up to ~1000 steps by radians, and Cos turns that into an error as large as its output."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from kiln.cli import main


def _rope_graph() -> onnx.ModelProto:
    """``y = ((x @ w) * cos(concat(inv_freq @ positions))) @ w2``: positions are int64 token positions."""
    rng = np.random.default_rng(0)
    weights = {
        "inv_freq": (1.0 / 10000 ** (np.arange(0, 8, 2) / 8)).astype(np.float32).reshape(4, 1),
        "w": (rng.standard_normal((8, 8)) * 0.3).astype(np.float32),
        "w2": (rng.standard_normal((8, 4)) * 0.3).astype(np.float32),
        "ax1": np.array([1], np.int64),
    }
    node = helper.make_node
    nodes = [
        node("Cast", ["pos"], ["posf"], to=TensorProto.FLOAT, name="node_cast"),
        node("Unsqueeze", ["posf", "ax1"], ["pos3"], name="node_unsq"),
        node("MatMul", ["inv_freq", "pos3"], ["freqs"], name="node_phase"),
        node("Transpose", ["freqs"], ["ft"], perm=[0, 2, 1], name="node_tr"),
        node("Concat", ["ft", "ft"], ["emb"], axis=-1, name="node_cat"),
        node("Cos", ["emb"], ["cos"], name="node_cos"),
        node("MatMul", ["x", "w"], ["xw"], name="node_proj"),
        node("Mul", ["xw", "cos"], ["rot"], name="node_rot"),
        node("MatMul", ["rot", "w2"], ["y"], name="node_head"),
    ]
    value = helper.make_tensor_value_info
    graph = helper.make_graph(
        nodes,
        "rope",
        [value("x", TensorProto.FLOAT, ["batch", 32, 8]), value("pos", TensorProto.INT64, ["batch", 32])],
        [value("y", TensorProto.FLOAT, ["batch", 32, 4])],
        [numpy_helper.from_array(v, k) for k, v in weights.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_int8_keeps_a_rotary_phase_in_float(tmp_path: Path) -> None:
    onnx.save(_rope_graph(), tmp_path / "m.onnx")
    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 32, 8)).astype(np.float32)
    np.savez(tmp_path / "d.npz", x=x, pos=np.tile(np.arange(32, dtype=np.int64) * 30, (64, 1)))
    args = ["precision", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "v"), "--variants", "int8"]
    result = CliRunner().invoke(
        main, [*args, "--calibration", str(tmp_path / "d.npz"), "--set", "precision.fallback.enabled=false"]
    )
    assert result.exit_code == 0, result.output
    variant = json.loads((tmp_path / "v" / "variants.json").read_text())["variants"]["int8"]
    assert not variant.get("unmade"), variant["unmade"]  # the phase quantized: cosine ~0.2, the gates fail
    assert "node_phase" in variant["kept_fp32"] and "phase" in variant["reasons"]["node_phase"]
    graph = onnx.load(tmp_path / "v" / "int8" / "model.onnx").graph
    made_by = {o: n.op_type for n in graph.node for o in n.output}
    phase = next(n for n in graph.node if n.name == "node_phase")
    assert "DequantizeLinear" not in [made_by.get(i) for i in phase.input]
    assert "node_proj" not in variant["kept_fp32"]  # the model's own layers are still quantized
