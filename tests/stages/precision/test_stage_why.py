"""How the precision stage says a variant was not made: a graph its calibration quantized nothing in is no variant
of that precision, not one that missed its gates."""

from __future__ import annotations

from kiln.stages.precision.stage import _why
from kiln.stages.precision.variants import QUANTIZED_NOTHING


def test_a_graph_that_quantized_nothing_is_not_said_to_miss_its_gates() -> None:
    record = {"passed": False, "failures": [f"{QUANTIZED_NOTHING} to int8"], "tried": [], "rounds": []}
    said = _why("int8 (Q/DQ graph)", record, "int8")
    assert said == f"int8 (Q/DQ graph) not made: {QUANTIZED_NOTHING} to int8", said
    missed = _why("int8", {"passed": False, "failures": ["cosine 0.9 < 0.99"], "tried": [], "rounds": []}, "int8")
    assert "no fallback round passed the gates" in missed
