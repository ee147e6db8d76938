"""Where the run lowered PyTorch's threads for a busy machine, the baselines are timed on the lowered count (a
baseline on threads the load holds measures the load, not PyTorch), and the timing record says so; on an idle
machine they are timed on PyTorch's own count."""

from __future__ import annotations

import os
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from kiln.core.progress import SilentProgress
from kiln.core.threads import cpu_threads_for_load
from kiln.stages.validate.config import ValidateConfig
from kiln.stages.validate.stage import time_interleaved

SEEN: list[int] = []


def _timer(calls: int, budget_s: float | None) -> list[float]:
    SEEN.append(torch.get_num_threads())  # the threads the baseline would run on
    return [0.01] * calls


@pytest.fixture
def two_threads(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """PyTorch on 2 threads of 2 cores, the thread count Kiln's to choose (no OMP_NUM_THREADS)."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    SEEN.clear()
    yield
    torch.set_num_threads(before)


def _timed(monkeypatch: pytest.MonkeyPatch, load: float) -> dict:
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    cfg = ValidateConfig(rounds=6, iterations=2, time_budget_s=0.05)
    with cpu_threads_for_load(say=False):
        _, info = time_interleaved(
            {"baseline eager-cpu": {1: _timer}}, [1], cfg, SimpleNamespace(progress=SilentProgress())
        )
        assert torch.get_num_threads() == (1 if load > 1 else 2)  # the run's count is back after the timing
    return info


def test_a_busy_machine_times_the_baselines_on_the_threads_the_load_left(
    monkeypatch: pytest.MonkeyPatch, two_threads: None
) -> None:
    info = _timed(monkeypatch, load=8.0)
    assert set(SEEN) == {1} and info["torch_threads"] == 1
    assert "left PyTorch 1 of its 2 threads" in info["torch_threads_reason"]


def test_an_idle_machine_times_them_on_pytorch_s_own_threads(
    monkeypatch: pytest.MonkeyPatch, two_threads: None
) -> None:
    info = _timed(monkeypatch, load=0.0)
    assert set(SEEN) == {2} and info["torch_threads"] == 2 and "torch_threads_reason" not in info
