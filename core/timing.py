"""Timing calls: CUDA events around each call on a GPU, the wall clock elsewhere."""

from __future__ import annotations

import time
from typing import Any

MIN_TIMED = 3  # calls timed whatever the budget: a median needs a few


def warm_up(fn: Any, calls: int, budget_s: float | None = None) -> None:
    """Up to ``calls`` untimed calls; with ``budget_s``, none after a quarter of it is spent (one call at least: a
    call that slow is past its first-call costs after one)."""
    t0 = time.perf_counter()
    for i in range(calls):
        if i and budget_s is not None and time.perf_counter() - t0 > budget_s / 4:
            break
        fn()


def time_calls(fn: Any, iterations: int, cuda: bool | None = None, budget_s: float | None = None) -> list[float]:
    """ms per call: CUDA events around each call when ``cuda`` (default: when torch sees a GPU; ``fn`` runs its
    work on the current stream or synchronizes, so they bracket it), else wall clock (CPU sessions and
    ``run_with_iobinding`` return only when the work is done). ``budget_s``: stop after that many seconds once
    :data:`MIN_TIMED` calls are timed (a large batch on a slow device times fewer calls, not for minutes)."""
    if cuda is None:
        try:
            import torch

            cuda = torch.cuda.is_available()
        except ImportError:
            cuda = False
    if cuda:
        import torch
    times: list[float] = []
    deadline = time.perf_counter() + budget_s if budget_s is not None else float("inf")
    for _ in range(iterations):
        if len(times) >= MIN_TIMED and time.perf_counter() > deadline:
            break
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times
