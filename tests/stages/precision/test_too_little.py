"""A variant with too little of its compute in its precision is not made, said with the cause: the nodes the
fallback kept in float, or the op types that carry the FLOPs and are not quantized (an LSTM, which no runtime
computes in INT8 from Q/DQ but ONNX Runtime CPU's dynamic graph does; a GRU, which nothing does; an op type left out
of calibration.op_types), each with a fix that applies."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from kiln.stages.precision.stage import KEPT_HINT, mark_too_little
from tests.calibration.calib_graphs import save_x_to_y

OP_TYPES = ["Conv", "ConvTranspose", "MatMul", "Gemm"]  # calibration.op_types' defaults


def qdq_head(inits: list[onnx.TensorProto], nodes: list[onnx.NodeProto], x: str, d: int) -> None:
    """``y = x @ W``, W [d, 4] an INT8 weight through a DequantizeLinear: the one quantized layer."""
    inits += [
        numpy_helper.from_array(np.ones((d, 4), np.int8), "head_wq"),
        numpy_helper.from_array(np.array(0.1, np.float32), "head_s"),
        numpy_helper.from_array(np.array(0, np.int8), "head_z"),
    ]
    nodes += [
        helper.make_node("DequantizeLinear", ["head_wq", "head_s", "head_z"], ["head_w"]),
        helper.make_node("MatMul", [x, "head_w"], ["y"], name="head"),
    ]


def lstm_then_head(path: Path, hidden: int = 16, op: str = "LSTM") -> None:
    """A float LSTM (or GRU: ``op``) over [batch, seq, 3] (not among the quantized op types), then an INT8 head."""
    gates = {"LSTM": 4, "GRU": 3}[op]
    inits = [
        numpy_helper.from_array(np.ones((1, gates * hidden, 3), np.float32), "w"),
        numpy_helper.from_array(np.ones((1, gates * hidden, hidden), np.float32), "r"),
        numpy_helper.from_array(np.array([1], np.int64), "dirs"),
    ]
    nodes = [
        helper.make_node(op, ["x", "w", "r"], ["", "h"], name="lstm", hidden_size=hidden, layout=1),
        helper.make_node("Squeeze", ["h", "dirs"], ["h2"]),
    ]
    qdq_head(inits, nodes, "h2", hidden)
    save_x_to_y(path, nodes, inits, ["batch", "seq", 3])


def conv_then_head(path: Path) -> None:
    """A float Conv over [batch, 8, 16, 16] (most of the FLOPs), pooled, then an INT8 head."""
    inits = [numpy_helper.from_array(np.ones((8, 8, 3, 3), np.float32), "k")]
    nodes = [
        helper.make_node("Conv", ["x", "k"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("GlobalAveragePool", ["c"], ["p"]),
        helper.make_node("Flatten", ["p"], ["f"]),
    ]
    qdq_head(inits, nodes, "f", 8)
    save_x_to_y(path, nodes, inits, ["batch", 8, 16, 16])


def _entry(kept: list[str] | None = None) -> dict:
    return {"path": "int8/model.onnx", "kept_fp32": kept or [], "reasons": {}, "fallback": {"passed": True}}


def test_an_lstm_the_qdq_graph_cannot_reach_is_named_with_onnx_runtime_cpus_dynamic_int8(tmp_path: Path) -> None:
    """An LSTM computes in float from Q/DQ, but ONNX Runtime CPU's dynamically quantized graph runs it in INT8
    (DynamicQuantizeLSTM): the fix says so, not that it cannot run in INT8."""
    lstm_then_head(tmp_path / "int8" / "model.onnx")
    entry = _entry()
    mark_too_little("int8", entry, tmp_path, {"seq": 24}, OP_TYPES)
    assert "0 nodes kept in float" in entry["unmade"] and "in LSTM 100%" in entry["unmade"]
    assert "no runtime computes LSTM in int8 from Q/DQ" in entry["unmade"]
    assert "ONNX Runtime CPU computes LSTM in int8 through dynamic quantization only" in entry["unmade"]
    hint = entry["unmade_hint"]
    assert hint.startswith("ONNX Runtime CPU engines run LSTM in int8 from their own graph, dynamically quantized")
    assert "for other backends drop int8 from precision.variants" in hint
    assert "cannot run" not in hint and "fp16" not in hint and "loosen" not in hint


def test_a_gru_no_runtime_computes_in_int8_is_said_so_without_a_cpu_fp16_fix(tmp_path: Path) -> None:
    """ONNX Runtime's dynamic quantization has no int8 GRU kernel: drop int8, and fp16 only on a GPU backend (the
    CPU builds no FP16 engine)."""
    lstm_then_head(tmp_path / "int8" / "model.onnx", op="GRU")
    entry = _entry()
    mark_too_little("int8", entry, tmp_path, {"seq": 24}, OP_TYPES)
    assert "no runtime computes GRU in int8 from Q/DQ" in entry["unmade"]
    assert "nor through ONNX Runtime's dynamic quantization" in entry["unmade"]
    assert entry["unmade_hint"] == (
        "drop int8 from precision.variants for this model: GRU cannot run in int8 (on a GPU backend, fp16 keeps it "
        "in low precision)"
    )


def test_an_op_type_left_out_of_calibration_is_named_with_the_setting(tmp_path: Path) -> None:
    conv_then_head(tmp_path / "int8" / "model.onnx")
    entry = _entry()
    mark_too_little("int8", entry, tmp_path, {}, ["MatMul", "Gemm"])
    assert "Conv is not in calibration.op_types" in entry["unmade"]
    assert entry["unmade_hint"] == "add Conv to calibration.op_types"


def test_nodes_the_fallback_kept_are_the_cause_where_they_hold_the_flops(tmp_path: Path) -> None:
    conv_then_head(tmp_path / "int8" / "model.onnx")
    entry = _entry(kept=["conv"])
    mark_too_little("int8", entry, tmp_path, {}, OP_TYPES)
    assert "(1 node kept in float to pass the gates)" in entry["unmade"]
    assert entry["unmade_hint"] == KEPT_HINT


def test_nodes_a_setting_excluded_are_said_with_that_setting_not_the_gates(tmp_path: Path) -> None:
    """calibration.exclude_op_types kept the Conv that holds the FLOPs: no gate kept it, so neither the reason nor the
    fix speaks of gates; the fix names the setting and precision.require_speedup."""
    conv_then_head(tmp_path / "int8" / "model.onnx")
    entry = {**_entry(kept=["conv"]), "reasons": {"conv": "Conv in calibration.exclude_op_types"}}
    mark_too_little("int8", entry, tmp_path, {}, OP_TYPES)
    assert "(1 node excluded by calibration.exclude_op_types)" in entry["unmade"]
    assert "gates" not in entry["unmade"] and "gates" not in entry["unmade_hint"]
    assert entry["unmade_hint"].startswith("calibration.exclude_op_types keeps most of the compute in float")
    assert "take those nodes out of calibration.exclude_op_types" in entry["unmade_hint"]
    assert "precision.require_speedup: true" in entry["unmade_hint"]


def test_nodes_kept_by_a_setting_and_by_the_fallback_are_counted_apart(tmp_path: Path) -> None:
    conv_then_head(tmp_path / "int8" / "model.onnx")
    reasons = {
        "conv": "fallback round 1: cosine 0.9",
        "head": "first/last compute layer (calibration.exclude_first_last)",
    }
    entry = {**_entry(kept=["conv", "head"]), "reasons": reasons}
    mark_too_little("int8", entry, tmp_path, {}, OP_TYPES)
    assert (
        "(1 node kept in float to pass the gates, 1 node excluded by calibration.exclude_first_last)"
        in (entry["unmade"])
    )
    assert entry["unmade_hint"] == KEPT_HINT  # the fallback's conv holds most of the FLOPs


class _JustUnder:
    """An audit of a graph with just under half its FLOPs in int8."""

    total = 1

    def share(self) -> dict[str, float]:
        return {"int8": 0.4996, "fp32": 0.5004}


def test_a_share_just_under_the_limit_is_not_said_as_the_limit(tmp_path: Path, monkeypatch) -> None:
    """49.96% printed as "50% ..., under the 50% an engine labelled int8 must run" contradicted itself."""
    monkeypatch.setattr("kiln.stages.precision.stage.audit_graph", lambda path, sizes: _JustUnder())
    monkeypatch.setattr("kiln.stages.precision.stage.too_little", lambda *args: ("the cause", "the fix"))
    entry = _entry()
    mark_too_little("int8", entry, tmp_path, {}, OP_TYPES)
    assert entry["unmade"].startswith("int8 not made: 49.9% of its FLOPs run in int8 (the cause), under the 50%")
