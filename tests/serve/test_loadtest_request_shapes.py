"""`kiln loadtest` says the sizes its requests had on the engine's dynamic axes (a point cloud's point count): a
throughput figure means little without them."""

from __future__ import annotations

import numpy as np

from kiln.serve.loadtest import dynamic_sizes, render_markdown, request_shapes
from tests.serve.served import served


def _result(pool: list[dict]) -> dict:
    meta = served({"points": (["batch", "N", 3], "float32")}, [1, 4]).meta
    latency = {"p50": 1.0, "p90": 1.0, "p99": 1.0}
    level = {"concurrency": 1, "requests": 9, "throughput_rps": 50.0, "latency_ms": latency, "mismatches": 0}
    deviation = {"batches": [4], "rtol": {"logits": 0.0}, "largest": {"logits": 0.0}, "atol": 0.0, "separation": None}
    tolerance = {"atol": 1e-5, "rtol": 1e-5, "base": {"atol": 1e-5, "rtol": 1e-5}, "batch_deviation": deviation}
    tolerance["safety"] = 4.0
    return {
        "model": "m",
        "engine": "e",
        "precision": "fp32",
        "url": "u",
        "inputs": "real",
        "duration_s": 1,
        "max_requests": 9,
        "levels": [level | {"errors": 0}],
        "tolerance": tolerance,
        "request_shapes": request_shapes(pool),
        "dynamic_sizes": dynamic_sizes(meta, pool),
    }


def test_the_report_names_each_requests_shape_and_its_dynamic_axes_sizes() -> None:
    pool = [{"points": np.zeros((1, 1024, 3), np.float32)} for _ in range(3)]
    result = _result(pool)
    assert result["request_shapes"] == {"points": [[1, 1024, 3]]} and result["dynamic_sizes"] == {"N": [1024]}
    text = render_markdown(result)
    assert "Each request's inputs: points: [1, 1024, 3] (dynamic axes: N = 1024)." in text


def test_requests_of_several_sizes_are_said_each() -> None:
    pool = [{"points": np.zeros((1, n, 3), np.float32)} for n in (512, 1024, 512)]
    result = _result(pool)
    assert result["request_shapes"] == {"points": [[1, 512, 3], [1, 1024, 3]]}
    assert "N = 512 or 1024" in render_markdown(result)
