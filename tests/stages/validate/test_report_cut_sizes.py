"""The validation section of report.md says how the held-out inputs were made at validated sizes below the data's
own (cut, keeping their first positions), as it does for those past it (lengthened)."""

from __future__ import annotations

from kiln.core.records import Baseline, ValidationResult
from kiln.stages.validate.report import report_section


def _lines(shapes: list[dict[str, int]]) -> list[str]:
    base = Baseline(accuracy=1.0, samples=32, latency_ms={}, logits_output="logits", compared=["logits"])
    base.shapes, base.scored_at = shapes, {"P": 256}
    return report_section(ValidationResult(passed=True, baseline=base, engines=[], failures=[]))


def test_a_size_below_the_datas_is_said_to_keep_the_first_positions() -> None:
    line = next(line for line in _lines([{"P": 32}, {"P": 256}]) if "Dynamic axes validated at" in line)
    assert (
        "Dynamic axes validated at: P=32; P=256 (at P=32 the held-out inputs are cut short of the data's own P=256 "
        "by keeping their first positions along the axis" in line
    ), line


def test_sizes_on_both_sides_say_both() -> None:
    line = next(line for line in _lines([{"P": 32}, {"P": 1024}]) if "Dynamic axes validated at" in line)
    assert "(at P=1024 the held-out inputs are lengthened past the data's own P=256:" in line, line
    assert "; at P=32 they are cut short of the data's own P=256 by keeping their first positions" in line, line
