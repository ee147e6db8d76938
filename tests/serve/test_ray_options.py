"""The Ray Serve application's deployment options, read from the application `serve run` would start (no cluster)."""

from __future__ import annotations

import pytest

pytest.importorskip("ray.serve", reason="the Ray Serve application needs `pip install kiln[ray]`")


def test_a_replica_holds_a_full_batch_and_the_next_one_forming() -> None:
    """@serve.batch batches only the requests its replica holds: with Ray's default of 5 ongoing requests every
    batch stopped at 5 and the rest queued in front of the replica (measured in benchmarks/README.md, Serving)."""
    from kiln.serve.ray_app import build_app

    def held(max_batch: int) -> int:
        app = build_app({"engine_dir": "/e", "model_name": "m", "max_batch_size": max_batch})
        return app._bound_deployment.max_ongoing_requests

    assert held(32) == 64 and held(1) == 5 and held(0) == 5  # 0: no batching, Ray's own default
