"""The INT8 graph ONNX Runtime CPU engines run (``model.ort_cpu.onnx``) goes through the accuracy fallback itself:
passing on the symmetric Q/DQ graph says nothing about it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import helper

from kiln.calibration.config import CalibrationConfig
from kiln.stages.accuracy.config import GatesConfig
from kiln.stages.precision import variants
from kiln.stages.precision.config import FallbackConfig
from kiln.stages.precision.fallback import FallbackResult
from kiln.stages.precision.gate import GateCheck
from kiln.stages.precision.stage import _ort_cpu_summary, not_made
from kiln.stages.precision.variants import Source, build_int8, ort_cpu_with_fallback
from tests.stages.precision.precision_graphs import inputs, make_model, rng_weights


def mlp_graph():
    nodes = [
        helper.make_node("MatMul", ["input", "w1"], ["h"], name="mm1"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", "w2"], ["logits"], name="head"),
    ]
    return make_model(nodes, {"w1": rng_weights(16, 32), "w2": rng_weights(32, 10, seed=1)})


def outlier_inputs(n: int = 256) -> np.ndarray:
    """Ordinary samples plus one in 32 with a huge first feature. The Q/DQ graph's calibrated (static) scales
    clip the outlier and hurt only it; ORT CPU's dynamic quantization measures each batch's range, so one
    outlier coarsens every sample of its batch."""
    x = inputs(n, seed=1)
    x[::32, 0] = 300.0
    return x


def test_ort_cpu_graph_gets_its_own_fallback(tmp_path: Path) -> None:
    cal = [inputs(32, seed=s) for s in range(4)]
    src = Source.prepare(mlp_graph(), tmp_path / "fp32" / "model.onnx", cal, None)
    x = outlier_inputs()
    # The gate at top-1 0.9 alone: the outlier rows dominate the cosine of both graphs, which is not this test's point
    gates = GatesConfig(per_precision={"int8": {"min_cosine": -1.0, "min_top1_agreement": 0.9}})
    check = GateCheck.on_samples(src.model, x, gates=gates)
    entry = build_int8(src, tmp_path / "int8" / "model.onnx", CalibrationConfig(cache=False), FallbackConfig(), check)
    ort = entry["ort_cpu"]
    assert ort["scheme"] == "dynamic"  # auto: MatMul layers and no convolutions
    assert entry["fallback"]["rounds"][0]["top1_agreement"] >= 0.9  # the Q/DQ graph passes as it is ...
    assert ort["fallback"]["rounds"][0]["top1_agreement"] < 0.9  # ... the graph ORT CPU runs does not
    # Its own fallback gets it through the gate only with both MatMuls in float: no INT8 left, so no such graph.
    # The variant is made with the Q/DQ graph for every backend (ONNX Runtime CPU runs it, as checked, in ORT CPU).
    assert not ort["fallback"]["passed"] and "no compute node is left in int8" in ort["fallback"]["failures"][-1]
    assert not_made("int8", entry) is None
    assert "backend_paths" not in entry and "onnxruntime-cpu graph" in entry["ort_cpu_unmade"]


def test_every_node_the_ort_cpu_graph_keeps_in_float_is_listed_with_its_reason(tmp_path: Path) -> None:
    """The ORT CPU graph starts from the nodes the Q/DQ graph kept: they are kept in it too, so they are listed
    with their reason beside those its own fallback adds, and the summary's count is the number of nodes listed
    (report.json said ``"ort_cpu_kept_fp32": 4`` beside ``"ort_cpu_kept_fp32_nodes": {}``)."""
    cal = [inputs(32, seed=s) for s in range(4)]
    src = Source.prepare(mlp_graph(), tmp_path / "fp32" / "model.onnx", cal, None)
    check = GateCheck.on_samples(src.model, inputs(64, seed=1))
    start = {"mm1": "kept in the Q/DQ graph (fallback round 1: output error 0.05)"}
    out = tmp_path / "int8" / "model.ort_cpu.onnx"
    out.parent.mkdir()
    ort = ort_cpu_with_fallback(src, out, CalibrationConfig(cache=False), FallbackConfig(), check, start, {"head"})
    assert ort["kept_fp32"] == ["mm1"] and ort["reasons"] == start
    summary = _ort_cpu_summary({**ort, "kept_fp32_modules": {}})
    assert summary["ort_cpu_kept_fp32"] == len(summary["ort_cpu_kept_fp32_nodes"]) == 1


def test_a_node_the_q_dq_graph_s_fallback_kept_says_so_in_the_ort_cpu_graph(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node the Q/DQ graph's fallback kept in float is listed for the ORT CPU graph as kept there, with the Q/DQ
    graph's reason: the ORT CPU graph's own fallback rounds did not keep it."""

    def fallback(build, check, precision, cfg, candidates, label):  # the Q/DQ graph's round 1 keeps mm1
        kept = {} if "onnxruntime-cpu" in label else {"mm1": "fallback round 1: output error 0.05"}
        return FallbackResult(path=build(set(kept)), kept=kept)

    monkeypatch.setattr(variants, "run_fallback", fallback)
    src = Source.prepare(mlp_graph(), tmp_path / "fp32" / "model.onnx", [inputs(32, seed=0)], None)
    check = GateCheck.on_samples(src.model, inputs(64, seed=1))
    entry = build_int8(src, tmp_path / "int8" / "model.onnx", CalibrationConfig(cache=False), FallbackConfig(), check)
    assert entry["reasons"] == {"mm1": "fallback round 1: output error 0.05"}
    assert entry["ort_cpu"]["reasons"] == {"mm1": "kept in the Q/DQ graph (fallback round 1: output error 0.05)"}
