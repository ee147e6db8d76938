"""The reasons of the nodes a fallback keeps stay true after pruning puts a round's nodes back."""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import helper

from kiln.stages.precision.config import FallbackConfig
from kiln.stages.precision.fallback import _prune
from kiln.stages.precision.gate import GateCheck
from tests.stages.precision.precision_graphs import inputs, make_model, rng_weights

WHY = "output error 0.0263 vs inputs' 0.0157 (relative L2 vs FP32)"


def test_a_node_kept_for_feeding_one_that_pruning_put_back_does_not_call_it_kept(tmp_path: Path) -> None:
    """Round 1 kept 'relu' and bought nothing; round 2 kept 'mm', which feeds it, and passed. The graph without
    'relu' passes too, so pruning puts it back: 'mm''s reason still names it, as dropped, not as kept FP32."""
    nodes = [
        helper.make_node("MatMul", ["input", "w"], ["h"], name="mm"),
        helper.make_node("Relu", ["h"], ["logits"], name="relu"),
    ]
    fp32 = make_model(nodes, {"w": rng_weights(16, 10)})

    def build(extra: set[str]) -> Path:  # any choice of nodes: the FP32 graph itself, which passes every gate
        onnx.save(fp32, str(tmp_path / "variant.onnx"))
        return tmp_path / "variant.onnx"

    kept = {
        "relu": f"fallback round 1: {WHY}",
        "mm": f"fallback round 2: feeds relu (kept FP32) whose {WHY}",
        "other": f"fallback round 2: feeds relu_1 (kept FP32) whose {WHY}",  # another node: its reason stays
    }
    check = GateCheck.on_samples(fp32, inputs(64))
    pruned = _prune(build, check, "int8", FallbackConfig(), kept, [{"relu"}, {"mm", "other"}], [False, True], "int8")
    assert pruned is not None and pruned[1].passed
    assert pruned[0] == {
        "mm": f"fallback round 2: feeds relu (kept FP32 in round 1, dropped when it bought nothing measurable) "
        f"whose {WHY}",
        "other": kept["other"],
    }
