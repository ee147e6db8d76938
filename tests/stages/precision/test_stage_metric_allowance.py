"""A variant not made for its task metric's gate names the per-precision max_metric_drop that allows the drop
measured, in the metric's units: the default per-precision gates loosen the accuracy drop, not the metric's."""

from __future__ import annotations

from kiln.core.records import EngineValidation
from kiln.stages.accuracy.check import accuracy_failures, gates_for
from kiln.stages.accuracy.config import GatesConfig
from kiln.stages.accuracy.metrics import Metric
from kiln.stages.precision import stage
from kiln.stages.precision.stage import _why

PSNR_MISS = "sr:psnr 30.57 vs 30.62: drop 0.05385 > max_metric_drop 0.01 at h=32, w=32"


def _record(round0: list[str]) -> dict:
    last = f"no compute node is left in int8 once the gates pass (round 0: {'; '.join(round0)})"
    rounds = [{"round": 0, "kept": 0, "failures": round0}, {"round": 1, "kept": 2, "failures": []}]
    return {"passed": False, "failures": [last], "tried": ["node_conv2d", "node_conv2d_1"], "rounds": rounds}


def test_a_missed_metric_gate_names_the_setting_that_allows_it() -> None:
    said = _why("int8", _record([PSNR_MISS]), precision="int8")
    assert "validate.gates.per_precision.int8.max_metric_drop: 0.054 allows it" in said, said
    assert "sr:psnr's drop with every node in int8 is 0.05385 (in sr:psnr's own units)" in said, said


def test_a_relative_metric_is_said_as_a_share_and_other_gates_stay_missed() -> None:
    failures = ["cosine 0.95 < 0.99", "mse 1.2 vs 1: relative rise 0.2 > max_metric_drop 0.01"]
    said = _why("int8 (Q/DQ graph)", _record(failures), "failed its gates", "int8")
    assert "a share of the reference's value" in said, said
    assert "per_precision.int8.max_metric_drop: 0.2 would pass that gate, not the others it misses" in said, said


def test_no_setting_is_named_where_the_metric_passed() -> None:
    said = _why("int8", _record(["cosine 0.95 < 0.99"]), precision="int8")
    assert "max_metric_drop" not in said, said


def test_the_allowance_reads_the_sentence_the_metric_gate_writes() -> None:
    """The setting is found in the failure as accuracy_failures words it, not in a copy of its words."""
    entry = EngineValidation(name="e", backend="b", precision="int8", device="cpu", status="validated")
    entry.metric = 30.57
    psnr = Metric("sr:psnr", lambda outputs, labels: 0.0)
    said = accuracy_failures(entry, gates_for(GatesConfig(), "int8"), None, psnr, 30.62)
    assert any(stage.METRIC_MISS.search(f) for f in said), said
