"""What `kiln loadtest` says batching moved the engine's answers by: an engine whose batched answers move by less
than its precision's base tolerance adds no band, yet its answers did move, which the report says."""

from __future__ import annotations

from typing import Any

import numpy as np

from kiln.serve.loadtest import TOLERANCE, batch_deviation, render_markdown

NUDGE = 3.5e-4  # what batching moves each answer by, of its scale: under INT8's base atol


class _Nudged:
    """y = x single, y = x + NUDGE batched: an engine whose batch mates move its answers a little."""

    def infer(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        x = feed["x"]
        return {"y": x + NUDGE if len(x) > 1 else x}


def _report(deviation: dict[str, Any]) -> str:
    tolerance = {
        "atol": 1e-2,
        "rtol": 1e-2,
        "base": {"atol": 1e-2, "rtol": 1e-2},
        "batch_deviation": deviation,
        "safety": 4.0,
    }
    latency = {"p50": 1.0, "p90": 1.0, "p99": 1.0}
    level = {"concurrency": 8, "requests": 9, "throughput_rps": 50.0, "latency_ms": latency, "mismatches": 0}
    result = {"model": "m", "engine": "e", "precision": "int8", "url": "u", "inputs": "real", "duration_s": 1}
    return render_markdown(result | {"max_requests": 9, "levels": [level | {"errors": 0}], "tolerance": tolerance})


def test_a_deviation_under_the_base_tolerance_is_said_with_its_size_not_as_none() -> None:
    pool = [{"x": np.full((1, 4), 1.0, np.float32)} for _ in range(8)]
    expected = [{"y": p["x"]} for p in pool]
    deviation = batch_deviation(_Nudged(), pool, expected, 8, TOLERANCE["int8"])
    assert deviation["rtol"]["y"] == 0.0 and deviation["largest"]["y"] > 0  # the base covers it: no band added
    md = _report(deviation)
    assert "none (identical)" not in md, md
    assert f"within the base tolerance (largest {deviation['largest']['y']:.3g} x the answer's scale)" in md, md


def test_none_is_said_only_where_batching_moved_nothing() -> None:
    deviation = {"batches": [8], "rtol": {"y": 0.0}, "largest": {"y": 0.0}, "atol": 0.0, "separation": None}
    assert "batches of 8 against its single-sample ones, none (identical)" in _report(deviation)
