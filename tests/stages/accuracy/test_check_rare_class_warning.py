"""The rare-class warning: said of a real shortfall by the engine's name, not at near-equal agreement, and without
asking for a metric the user may have set."""

import logging

import pytest

from kiln.core.records import EngineValidation
from kiln.stages.accuracy.check import compare_all, summarize
from tests.core.test_compare_class_agreement import dominated_volume


def _warned(caplog: pytest.LogCaptureFixture, rare_flipped: float, gates: dict | None = None) -> list[str]:
    ref, got = dominated_volume(rare_flipped)
    entry = EngineValidation(name="seg-int8", backend="onnxruntime", precision="int8", device="cpu", status="validated")
    entry.gates = gates or {}
    with caplog.at_level(logging.WARNING, logger="kiln.validate"):
        summarize(entry, compare_all({"y": ref}, {"y": got}, "y"), "y")
    return [r.getMessage() for r in caplog.records if "class 2 agrees" in r.getMessage()]


def test_real_shortfall_is_warned_by_name_without_asking_for_a_metric(caplog: pytest.LogCaptureFixture) -> None:
    said = _warned(caplog, 0.25)
    assert len(said) == 1 and said[0].startswith("engine seg-int8:")
    assert "below min_top1_agreement 0.97" in said[0]  # int8's default gate
    assert "Gate the rare classes with" not in said[0]  # no request to set validate.metric, which may be set


def test_class_passing_the_gate_is_not_warned_of(caplog: pytest.LogCaptureFixture) -> None:
    # 2 of the rare class's 256 positions flipped (0.992): within int8's 0.97 gate, noise beside the whole's
    assert not _warned(caplog, 2 / 256)
    # the entry's own gate decides: 0.75 passes a gate of 0.7
    assert not _warned(caplog, 0.25, {"min_top1_agreement": 0.7})


def test_warning_off_for_a_graph_judged_outside_validation(caplog: pytest.LogCaptureFixture) -> None:
    ref, got = dominated_volume(0.25)
    entry = EngineValidation(name="", backend="onnxruntime", precision="int8", device="cpu", status="validated")
    with caplog.at_level(logging.WARNING, logger="kiln.validate"):
        summarize(entry, compare_all({"y": ref}, {"y": got}, "y"), "y", warn=False)
    assert entry.outputs["y"]["worst_class_agreement"] == pytest.approx(0.75)  # still recorded
    assert not [r for r in caplog.records if "class 2 agrees" in r.getMessage()]
