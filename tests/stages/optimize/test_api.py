"""Where onnx-graphsurgeon's part of fold_constants changes the outputs, the safety net undoes that part alone: Kiln's
own folding steps (a weight stored transposed made a stored weight) stay, and the graph records what was undone."""

from __future__ import annotations

import onnx
from onnx import helper as h

from kiln.stages.optimize import api
from kiln.stages.optimize.api import optimize_model, optimize_record
from kiln.stages.optimize.config import OptimizeConfig
from kiln.stages.optimize.passes import fold
from tests.stages.optimize.optimize_helpers import FLOAT, f32, make_model, ops, same_outputs


def _transposed_weight() -> onnx.ModelProto:
    nodes = [
        h.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]),
        h.make_node("MatMul", ["x", "wt"], ["m"]),
        h.make_node("Relu", ["m"], ["y"]),
    ]
    return make_model(nodes, [("x", ["N", 4], FLOAT)], ["y"], {"w": f32(6, 4)})


def _relu_dropped(graph, size_threshold) -> None:
    """A library fold that breaks the graph: every Relu becomes an Identity."""
    for node in graph.nodes:
        if node.op == "Relu":
            node.op = "Identity"


def test_a_library_fold_that_changes_the_outputs_keeps_kilns_own_steps(monkeypatch):
    monkeypatch.setattr(fold, "library_fold", _relu_dropped)
    m = _transposed_weight()
    out, s = optimize_model(m, OptimizeConfig(passes=["fold_constants", "toposort"]))
    assert ops(out) == ["MatMul", "Relu"]  # the Transpose folded, the Relu kept
    assert s["rolled_back"] == ["fold_constants (onnx-graphsurgeon's folding)"]
    entry = next(p for p in s["passes"] if p["name"] == "fold_constants")
    assert entry["params"]["library"] is False and entry["fallback"]["params"]["library"] is True
    assert "max abs error" in entry["fallback"]["reason"] and not entry["rolled_back"]
    assert optimize_record(out) == {"passes": ["fold_constants", "toposort"], "rolled_back": s["rolled_back"]}
    same_outputs(m, out, {"x": f32(3, 4, seed=1)})
    assert api.checks_line(s).endswith("; rolled back: fold_constants (onnx-graphsurgeon's folding)")


def test_a_graph_optimized_cleanly_records_no_rollback():
    out, s = optimize_model(_transposed_weight(), OptimizeConfig(passes=["fold_constants"]))
    assert ops(out) == ["MatMul", "Relu"] and not s["rolled_back"]
    assert optimize_record(out) == {"passes": ["fold_constants"], "rolled_back": []}
    assert optimize_record(_transposed_weight()) is None
    bad = _transposed_weight()
    h.set_model_props(bad, {api.OPTIMIZE_RECORD_KEY: "not json"})
    assert optimize_record(bad) is None
