"""A variant not made for its task metric's gate names the per-precision max_metric_drop that allows the drop
measured, in the metric's units: the default per-precision gates loosen the accuracy drop, not the metric's."""

from __future__ import annotations

from kiln.stages.precision.fallback import MetricGap
from kiln.stages.precision.stage import _why

PSNR_MISS = "sr:psnr 30.57 vs 30.62: drop 0.05385 > max_metric_drop 0.01 at h=32, w=32"
PSNR_GAP = MetricGap("sr:psnr", 0.05385, 0.01, "drop")


def _record(round0: list[str], gap: MetricGap | None) -> dict:
    last = f"no compute node is left in int8 once the gates pass (round 0: {'; '.join(round0)})"
    first = {"round": 0, "kept": 0, "failures": round0, **({"metric_gap": gap._asdict()} if gap else {})}
    rounds = [first, {"round": 1, "kept": 2, "failures": []}]
    return {"passed": False, "failures": [last], "tried": ["node_conv2d", "node_conv2d_1"], "rounds": rounds}


def test_a_missed_metric_gate_names_the_setting_that_allows_it() -> None:
    said = _why("int8", _record([PSNR_MISS], PSNR_GAP), "int8")
    assert "validate.gates.per_precision.int8.max_metric_drop: 0.054 allows it" in said, said
    assert "sr:psnr's drop with every node in int8 is 0.05385 (in sr:psnr's own units)" in said, said


def test_a_relative_metric_is_said_as_a_share_and_other_gates_stay_missed() -> None:
    failures = ["cosine 0.95 < 0.99", "mse 1.2 vs 1: relative rise 0.2 > max_metric_drop 0.01"]
    said = _why("int8 (Q/DQ graph)", _record(failures, MetricGap("mse", 0.2, 0.01, "relative rise")), "int8", "x")
    assert "a share of the reference's value" in said, said
    assert "per_precision.int8.max_metric_drop: 0.2 would pass that gate, not the others it misses" in said, said


def test_no_setting_is_named_where_the_metric_passed() -> None:
    said = _why("int8", _record(["cosine 0.95 < 0.99"], MetricGap("sr:psnr", 0.001, 0.01, "drop")), "int8")
    assert "max_metric_drop" not in said, said
    assert "max_metric_drop" not in _why("int8", _record(["cosine 0.95 < 0.99"], None), "int8"), said


def test_an_unmeasured_drop_names_no_setting() -> None:
    said = _why("int8", _record([PSNR_MISS], MetricGap("sr:psnr", float("nan"), 0.01, "drop")), "int8")
    assert "max_metric_drop:" not in said, said
