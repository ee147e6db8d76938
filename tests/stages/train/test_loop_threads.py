"""Training follows the machine's load between epochs, on the CPU threads Kiln chose for the stage."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kiln.core import threads
from kiln.core.threads import cpu_threads_for_load
from kiln.stages.train.loop import train
from tests.stages.train.train_helpers import tiny_data, train_cfg


def _threads_per_epoch(monkeypatch: pytest.MonkeyPatch, loads: list[float]) -> list[int]:
    """PyTorch's thread count in each epoch of a 3-epoch run on 2 cores whose load is ``loads[i]`` when the stage
    starts (i = 0) and at the start of epoch i."""
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda _: {0, 1})
    at = iter(loads)
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (next(at), 0.0, 0.0))
    seen: list[int] = []
    data = tiny_data(80)  # 64 training rows: two steps of 32 an epoch
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    with cpu_threads_for_load(say=False):
        train(model, data, train_cfg(epochs=3), on_step=lambda step: seen.append(torch.get_num_threads()))
    return seen[::2]  # the first step of each epoch


def test_the_thread_count_follows_the_load_between_epochs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        # idle at the start (2 threads), busy by epoch 2 (1 thread), idle again for epoch 3 (back to 2)
        assert _threads_per_epoch(monkeypatch, [0.0, 0.0, 9.6, 0.3]) == [2, 1, 2]
        assert torch.get_num_threads() == 2  # the stage's end restores PyTorch's own count
        # started busy: never above the stage's first count, however idle the machine becomes
        assert _threads_per_epoch(monkeypatch, [5.0, 0.0, 0.0, 0.0]) == [1, 1, 1]
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_the_users_thread_count_stands(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert _threads_per_epoch(monkeypatch, [9.6, 9.6, 9.6, 9.6]) == [2, 2, 2]
    finally:
        torch.set_num_threads(before)
