"""`kiln loadtest` against a server that stops during a level: a stopping Triton unloads its models and answers
"no available versions" until its port closes, which ends the level as refused connections do; and a level found
gone only after it ran its full time counts its throughput over the time until its last answer."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kiln.serve import loadtest
from kiln.serve.http_client import HttpError
from kiln.serve.loadtest import GONE_AFTER, Level, no_server, render_markdown, run_level

UNLOADED = "[404] Request for unknown model: 'm' has no available versions"


class _Answer:
    def __init__(self, y: np.ndarray) -> None:
        self.y = y

    def as_numpy(self, name: str) -> np.ndarray:
        return self.y


def _stopping_server(answers: int) -> SimpleNamespace:
    """A stand-in for tritonclient.http whose server answers ``answers`` requests (y = x), then has unloaded the
    model, as a stopping Triton has."""
    lock, seen = threading.Lock(), [0]

    class Client:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def infer(self, model: str, inputs: list, **kwargs: Any) -> _Answer:
            with lock:
                seen[0] += 1
                if seen[0] > answers:
                    raise RuntimeError(UNLOADED)
            return _Answer(inputs[0].array)

        def close(self) -> None:
            pass

    class InferInput:
        def __init__(self, name: str, shape: list[int], dtype: str) -> None:
            self.array = None

        def set_data_from_numpy(self, array: np.ndarray, binary_data: bool = True) -> None:
            self.array = array

    return SimpleNamespace(InferenceServerClient=Client, InferInput=InferInput, seen=seen)


def test_a_model_the_server_unloaded_counts_as_no_server() -> None:
    assert no_server(RuntimeError(UNLOADED)) and no_server(
        HttpError("Request for unknown model: 'm' has no available versions")
    )
    assert not no_server(RuntimeError("[400] missing required input(s) 'attention_mask'"))


def test_a_level_ends_when_the_stopping_server_has_unloaded_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """The level's budget (10,000 requests) would be spent on failures were the unloaded model not taken for a gone
    server; its duration is far longer than the test."""
    server = _stopping_server(answers=20)
    monkeypatch.setattr(loadtest, "_client_module", lambda protocol: server)
    pool = [{"x": np.full((1, 4), k, np.float32)} for k in range(4)]
    expected = [{"y": p["x"]} for p in pool]
    level = run_level("http", "127.0.0.1:1", "m", pool, expected, (1e-5, 0.0), 2, 300.0, 10_000, switch_interval_s=None)
    assert level.server_gone and len(level.latencies_ms) == 20 and level.mismatches == 0
    assert GONE_AFTER <= len(level.errors) <= GONE_AFTER + 2 and "no available versions" in level.gone_error
    assert level.seconds == level.last_answer_s


def test_a_level_found_gone_after_its_time_counts_until_its_last_answer() -> None:
    from kiln.serve.loadtest import ended_at_last_answer

    summary = Level(4, latencies_ms=[1.0] * 2170, seconds=6.0, last_answer_s=2.0).summary()
    ended_at_last_answer(summary)
    assert summary["server_gone"] and summary["seconds"] == 2.0 and summary["throughput_rps"] == 1085.0
    result = {"model": "m", "engine": "e", "precision": "fp32", "url": "u", "inputs": "real", "duration_s": 6}
    md = render_markdown(result | {"max_requests": 9, "levels": [summary]})
    assert "| 4 | 2170 | 1085.0 (server stopped) |" in md, md
    assert "stopped answering 2.0 s into the level" in md and "counts those 2.0 s" in md, md
