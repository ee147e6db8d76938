"""Dense class logits one class dominates: the worst class's agreement is recorded and warned of."""

import logging

import pytest

from kiln.core.records import EngineValidation
from kiln.stages.accuracy.check import compare_all, merge_worst, summarize
from tests.core.test_compare_class_agreement import dominated_volume


def _entry() -> EngineValidation:
    return EngineValidation(name="e", backend="onnxruntime", precision="fp32", device="cpu", status="validated")


def test_worst_class_recorded_and_warned(caplog: pytest.LogCaptureFixture) -> None:
    ref, got = dominated_volume(0.25)
    stats = compare_all({"y": ref}, {"y": got}, "y")
    s = stats["y"]
    assert s.worst_class == 2 and abs(s.worst_class_agreement - 0.75) < 1e-9
    entry = _entry()
    with caplog.at_level(logging.WARNING, logger="kiln.validate"):
        summarize(entry, merge_worst({}, stats), "y")
    assert entry.outputs["y"]["worst_class_agreement"] == pytest.approx(0.75)
    said = [r.getMessage() for r in caplog.records if "macro_f1" in r.getMessage()]
    assert len(said) == 1 and "class 2 agrees at only 0.7500" in said[0]


def test_agreeing_engine_is_not_warned_of(caplog: pytest.LogCaptureFixture) -> None:
    ref, _ = dominated_volume(0.0)
    with caplog.at_level(logging.WARNING, logger="kiln.validate"):
        summarize(_entry(), compare_all({"y": ref}, {"y": ref.copy()}, "y"), "y")
    assert not [r for r in caplog.records if "macro_f1" in r.getMessage()]


def test_merge_keeps_the_worse_class() -> None:
    ref, got = dominated_volume(0.25)
    bad = compare_all({"y": ref}, {"y": got}, "y")
    good = compare_all({"y": ref}, {"y": ref.copy()}, "y")
    assert merge_worst(good, bad)["y"].worst_class_agreement == pytest.approx(0.75)
    assert merge_worst(bad, good)["y"].worst_class_agreement == pytest.approx(0.75)
