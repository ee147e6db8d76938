"""The note that says why a faster engine did not take the choice: noise only where the interval reaches 1."""

from __future__ import annotations

import numpy as np

from kiln.core.records import EngineValidation, Percentiles
from kiln.stages.validate.stage import choose, kept_note


def test_a_real_lead_under_the_margin_is_not_called_noise() -> None:
    note = kept_note("onnxruntime-cpu-fp32", "onnxruntime-cpu-int8", 1.07, (1.02, 1.08), margin=0.03)
    assert "noise" not in note
    assert "its lead (95 % interval 1.02-1.08x) does not clear validate.choice_margin (3 %)" in note
    assert note.endswith("onnxruntime-cpu-fp32 kept (listed first: backend preference, then name)")


def test_an_interval_reaching_one_is_the_timings_noise() -> None:
    note = kept_note("trt", "ort", 1.10, (0.95, 1.20), margin=0.03)
    assert "ort measured 1.10x faster than trt at p50, within the timing's noise (95 % interval 0.95-1.20x)" in note


def test_choose_words_a_lead_under_the_margin_as_such() -> None:
    """INT8 2-8 % faster in every round (6 % at p50): a real lead whose interval starts under the 3 % margin; FP32
    (listed first) is kept, and the note does not call the lead noise."""

    def e(name: str, rounds: list[float]) -> EngineValidation:
        p50 = float(np.median(rounds))
        return EngineValidation(
            name=name, backend="onnxruntime", precision="fp32", device="cpu", status="validated", passed=True,
            latency_ms={"1": Percentiles(p50=p50, p90=p50, p99=p50, rounds=rounds)},
        )  # fmt: skip

    fp32 = e("a-fp32", [1.0] * 8)
    int8 = e("b-int8", [1 / r for r in (1.02, 1.07, 1.06, 1.07, 1.02, 1.08, 1.07, 1.06)])
    chosen, notes = choose([fp32, int8], ["onnxruntime"], margin=0.03)
    assert chosen == {"1": "a-fp32"}
    assert "does not clear validate.choice_margin (3 %)" in notes["1"] and "noise" not in notes["1"]
