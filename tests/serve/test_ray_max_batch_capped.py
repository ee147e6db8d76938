"""The Ray Serve app given a max_batch_size above the largest batch its engine was validated at: batches and
requests stop at the validated size, and the replica says so (as `kiln serve --max-batch` does)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from tests.serve.served import served

pytest.importorskip("ray.serve", reason="the Ray Serve application needs `pip install kiln[ray]`")

from kiln.serve import ray_app  # noqa: E402  (after the skip: it imports ray)


def _replica(monkeypatch: pytest.MonkeyPatch, max_batch: int) -> object:
    meta = served({"points": (["batch", "N", 3], "float32")}, [1, 4]).meta
    runner = SimpleNamespace(activate=lambda: runner, meta=meta)
    monkeypatch.setattr(ray_app, "engine_folder", lambda d: d)
    monkeypatch.setattr(ray_app, "read_metadata", lambda d: meta)
    monkeypatch.setattr(ray_app, "load_engine", lambda d, serving: runner)
    return ray_app.KilnEngine.func_or_class("e", "m", max_batch, 0.002)


def test_a_max_batch_size_above_the_validated_batches_is_capped_and_said(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="ray.serve"):
        replica = _replica(monkeypatch, 64)
    assert replica.max_rows == 4 and replica.infer_batch._get_max_batch_size() == 4
    assert "model m: max_batch_size 64 capped to 4, the largest batch its engine was validated at" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ray.serve"):
        assert _replica(monkeypatch, 4).max_rows == 4  # what was validated: nothing to say
    assert "capped" not in caplog.text
