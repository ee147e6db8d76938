"""PyTorch's threads on a busy machine: only the cores the load leaves idle, the user's choice kept."""

from __future__ import annotations

import logging

import pytest
import torch

from kiln.core import threads
from kiln.core.threads import cpu_threads_for_load, follow_load, lowered_from, threads_for_load


@pytest.mark.parametrize(
    ("cores", "load", "current", "want"),
    [
        (2, 0.2, 2, 2),  # idle: PyTorch's own choice
        (2, 0.6, 2, 2),
        (2, 1.0, 2, 1),  # one core taken
        (2, 8.0, 2, 1),  # every core taken: one thread
        (16, 10.0, 16, 6),  # the idle cores
        (16, 40.0, 16, 1),
        (16, 10.0, 4, 4),  # never more than PyTorch's choice
    ],
)
def test_threads_for_load(cores: int, load: float, current: int, want: int) -> None:
    assert threads_for_load(cores, load, current) == want


def test_a_busy_machine_lowers_torch_threads_for_the_block_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda _: {0, 1})
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (9.0, 9.0, 9.0))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with caplog.at_level(logging.INFO, "kiln.core.threads"), cpu_threads_for_load() as n:
            assert n == 1 and torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2  # restored for the caller
        assert "busy machine (load average 9.0 on 2 cores): PyTorch runs on 1 thread(s)" in caplog.text
        monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's choice stands
        with cpu_threads_for_load() as n:
            assert n is None and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_lowered_block_records_pytorch_s_own_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """A busy machine lowers PyTorch's threads for the stage; the block records PyTorch's own count (what timing
    reports the baselines were lowered from), and nothing once it ends."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda _: {0, 1})
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (9.0, 9.0, 9.0))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with cpu_threads_for_load() as n:
            assert n == 1 and lowered_from() == 2 and torch.get_num_threads() == 1
        assert lowered_from() is None and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_follow_load_sets_the_count_for_the_load_now_within_the_block(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda _: {0, 1})
    load = [0.0]
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (load[0], 0.0, 0.0))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert follow_load() is None  # outside a block: Kiln chose nothing
        with cpu_threads_for_load() as n:
            assert n == 2
            load[0] = 9.0
            assert follow_load() == 1 and torch.get_num_threads() == 1
            assert lowered_from() == 2  # what timing says the baselines were lowered from
            load[0] = 0.0
            assert follow_load() == 2 and torch.get_num_threads() == 2
        assert torch.get_num_threads() == 2 and follow_load() is None
        monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's choice stands
        with cpu_threads_for_load() as n:
            load[0] = 9.0
            assert n is None and follow_load() is None and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
