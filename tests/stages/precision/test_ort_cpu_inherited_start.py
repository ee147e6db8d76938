"""The ONNX Runtime CPU INT8 graph starts from the nodes the Q/DQ graph kept in float; where it passes at once with
them, it is also tried without them (its scheme is another), and the passing graph with more of it in int8 is kept.
Its round lines count the inherited nodes."""

from __future__ import annotations

import logging
from pathlib import Path

import onnx
import pytest
from onnx import helper

from kiln.calibration.config import CalibrationConfig
from kiln.stages.accuracy.config import GatesConfig
from kiln.stages.precision.audit import MIN_SHARE, audit_graph
from kiln.stages.precision.config import FallbackConfig
from kiln.stages.precision.fallback import _log_choice
from kiln.stages.precision.gate import GateCheck
from kiln.stages.precision.stage import mark_too_little, not_made
from kiln.stages.precision.variants import Source, build_int8
from tests.stages.precision.precision_graphs import inputs, make_model, rng_weights

FEATURES, HIDDEN = 64, 256


def wide_then_head() -> onnx.ModelProto:
    """A wide MatMul (most of the FLOPs), a Sigmoid (its output in [0, 1] whatever the input's scale), a small head."""
    nodes = [
        helper.make_node("MatMul", ["input", "w1"], ["h"], name="wide"),
        helper.make_node("Sigmoid", ["h"], ["s"], name="squash"),
        helper.make_node("MatMul", ["s", "w2"], ["logits"], name="head"),
    ]
    weights = {"w1": rng_weights(FEATURES, HIDDEN, scale=0.2), "w2": rng_weights(HIDDEN, 10, seed=1)}
    return make_model(nodes, weights, features=FEATURES)


def _build(tmp_path: Path) -> dict:
    """Calibration data 100 times the scale of the held-out data: the Q/DQ graph's static input scale is then far too
    coarse and its fallback keeps ``wide`` in float; ONNX Runtime CPU's dynamic scheme measures each batch's range
    and needs no node in float."""
    cal = [inputs(32, FEATURES, seed=s, scale=100.0) for s in range(4)]
    src = Source.prepare(wide_then_head(), tmp_path / "fp32" / "model.onnx", cal, None)
    gates = GatesConfig(per_precision={"int8": {"min_cosine": 0.99, "min_top1_agreement": 0.9}})
    check = GateCheck.on_samples(src.model, inputs(128, FEATURES, seed=9), gates=gates)
    fallback = FallbackConfig(nodes_per_round=1)
    return build_int8(src, tmp_path / "int8" / "model.onnx", CalibrationConfig(cache=False), fallback, check)


def _share(path: Path) -> float:
    return audit_graph(path).share().get("int8", 0.0)


def test_ort_cpu_graph_passing_with_inherited_nodes_is_tried_without_them(tmp_path: Path) -> None:
    entry = _build(tmp_path)
    assert entry["fallback"]["passed"] and entry["kept_fp32"] == ["wide"]  # the Q/DQ graph needs it in float
    assert _share(tmp_path / entry["path"]) < MIN_SHARE
    ort = entry["ort_cpu"]
    assert ort["scheme"] == "dynamic" and ort["fallback"]["passed"]
    assert ort["kept_fp32"] == [] and ort["reasons"] == {}
    assert _share(tmp_path / "int8" / "model.ort_cpu.onnx") > MIN_SHARE
    assert ort["starts"]["inherited"] == ["wide"] and ort["starts"]["kept"] == "without"
    assert ort["starts"]["with"]["int8_share"] < ort["starts"]["without"]["int8_share"]


def test_the_precision_audit_then_keeps_the_ort_cpu_graph(tmp_path: Path) -> None:
    """The Q/DQ graph is too little in int8 and is not made; ONNX Runtime CPU engines read their own graph."""
    entry = _build(tmp_path)
    assert not_made("int8", entry) is None
    mark_too_little("int8", entry, tmp_path, {})
    assert "Q/DQ graph" in entry["unmade"]
    assert entry["backend_paths"] == {"onnxruntime-cpu": "int8/model.ort_cpu.onnx"}
    assert "ort_cpu_unmade" not in entry


def test_ort_cpu_round_lines_count_the_inherited_nodes(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kiln.precision"):
        _build(tmp_path)
    rounds = [
        r.getMessage() for r in caplog.records if "onnxruntime-cpu" in r.getMessage() and " round " in r.getMessage()
    ]
    assert len(rounds) == 2  # the inherited start, then one fallback without it
    assert "(1 nodes kept FP32: 1 inherited from the Q/DQ graph)" in rounds[0]
    assert "without the Q/DQ graph's nodes) round 0" in rounds[1] and "(0 nodes kept FP32)" in rounds[1]
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "kept without the Q/DQ graph's nodes: 0 nodes kept FP32" in said


def test_the_log_says_which_graph_the_timing_kept(caplog: pytest.LogCaptureFixture) -> None:
    """Where the pruned graph passes too, the faster of the two is kept: the log says whether the pruned nodes went
    back in int8 or stayed in float, not only that the gates allow them back."""
    timing = {"p50_ms": {"as found": 0.39, "pruned": 0.91}, "kept": "as found"}
    with caplog.at_level(logging.INFO, logger="kiln.precision"):
        _log_choice("int8", "int8", ["node_conv2d", "node_relu"], timing)
        _log_choice("int8", "int8", ["node_conv2d"], {**timing, "kept": "pruned"})
    first, second = (r.getMessage() for r in caplog.records)
    assert "['node_conv2d', 'node_relu'] stay in float" in first and "0.39 ms" in first
    assert "['node_conv2d'] back in int8" in second
