"""The precision stage's rounds judge graphs, not engines: they say no rare-class warning (validation says it once
per engine, by its name), and still record the worst class's agreement."""

import logging

import pytest

from kiln.stages.accuracy.check import Comparison, compare_all, gates_for
from kiln.stages.accuracy.config import GatesConfig
from kiln.stages.precision.gate import _entry
from tests.core.test_compare_class_agreement import dominated_volume


def test_precision_round_says_no_rare_class_warning(caplog: pytest.LogCaptureFixture) -> None:
    ref, got = dominated_volume(0.25)
    found = Comparison(stats=compare_all({"y": ref}, {"y": got}, "y"))
    with caplog.at_level(logging.WARNING):
        for _ in range(3):  # a fallback's rounds
            entry = _entry(found, "int8", "y", gates_for(GatesConfig(), "int8"))
    assert entry.outputs["y"]["worst_class_agreement"] == pytest.approx(0.75)
    assert not [r for r in caplog.records if "class 2 agrees" in r.getMessage()]
