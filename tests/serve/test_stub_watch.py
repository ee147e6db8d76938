"""StubWatch's bookkeeping, without a server: which models it reloads and when (the real stub, killed under a real
``tritonserver``, is tests/serve/test_server.py's dead-stub test)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from kiln.serve.server import StubWatch


class Watch(StubWatch):
    """A StubWatch over a given list of live stubs; reloads recorded, and answered with ``reload_ok``."""

    def __init__(self, expected: dict[str, int], live: dict[Any, tuple[str, str]]) -> None:
        self.live, self.reloads, self.reload_ok = dict(live), [], True
        self.expected, self.stubs, self.failed = expected, dict(live), {}

    def _stubs(self) -> dict[Any, tuple[str, str]]:
        return dict(self.live)

    def _reload(self, model: str) -> bool:
        self.reloads.append(model)
        return self.reload_ok


class Proc:
    def __init__(self, pid: int) -> None:
        self.pid = pid


def test_a_stub_seen_alive_then_gone_is_named_and_its_model_reloaded(caplog: pytest.LogCaptureFixture) -> None:
    a, b, c = Proc(11), Proc(12), Proc(13)
    watch = Watch({"m": 2, "n": 1}, {a: ("m", "m_0_0"), b: ("m", "m_0_1"), c: ("n", "n_0_0")})
    assert watch.check() == [] and watch.reloads == []  # all there
    del watch.live[b]
    with caplog.at_level(logging.ERROR, "kiln.serve"):
        assert watch.check() == ["m"]
    assert "model m: instance m_0_1 died (stub process 12)" in caplog.text


def test_a_stub_that_died_before_the_watch_began_is_still_found(caplog: pytest.LogCaptureFixture) -> None:
    """Counted against the config's instances: a stub never seen alive (killed before the watch's first look)
    leaves its model short, and the model is reloaded all the same."""
    watch = Watch({"m": 2}, {Proc(11): ("m", "m_0_0")})
    with caplog.at_level(logging.ERROR, "kiln.serve"):
        assert watch.check() == ["m"]
    assert "model m: an instance's stub process is gone; reloading the model" in caplog.text


def test_a_failed_reload_is_tried_again_after_a_pause(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    now = [100.0]
    monkeypatch.setattr("kiln.serve.server.time.monotonic", lambda: now[0])
    watch = Watch({"m": 1}, {})
    watch.reload_ok = False
    with caplog.at_level(logging.ERROR, "kiln.serve"):
        assert watch.check() == [] and watch.reloads == ["m"]
        now[0] += StubWatch.RETRY_S / 2
        assert watch.check() == [] and watch.reloads == ["m"]  # not hammered
    assert caplog.text.count("stub process is gone") == 1  # said once, not at every check meanwhile
    now[0] += StubWatch.RETRY_S
    watch.reload_ok = True
    assert watch.check() == ["m"] and watch.reloads == ["m", "m"]
