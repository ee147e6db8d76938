"""Timing calls: CUDA events around each call on a GPU, the wall clock elsewhere."""

from __future__ import annotations

import math
import statistics
import sys
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


def time_calls(
    fn: Any, iterations: int, cuda: bool | None = None, budget_s: float | None = None, min_calls: int = MIN_TIMED
) -> list[float]:
    """ms per call: CUDA events around each call when ``cuda`` (default: when torch sees a GPU; ``fn`` runs its
    work on the current stream or synchronizes, so they bracket it), else wall clock (CPU sessions and
    ``run_with_iobinding`` return only when the work is done). ``budget_s``: stop after that many seconds once
    :data:`MIN_TIMED` (``min_calls``) calls are timed (a large batch on a slow device times fewer calls, not for
    minutes)."""
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
        if len(times) >= min_calls and time.perf_counter() > deadline:
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


# Interleaved timing: every contender (engines and baselines) is timed in short blocks, round after round, in a
# rotating order, so a load that comes and goes hits them all alike; each contender's figure is the median of its
# per-round medians, with a 95 % interval of it from the same medians (distribution-free; the median of all calls
# pooled can fall outside it), and ratios between two contenders come from their medians paired round by round.
MIN_ROUNDS = 6  # the fewest rounds whose [min, max] of medians is a 95 % interval of the median (1 - 2 / 2**6)
Timer = Any  # (calls, budget_s) -> ms per call


def interleave(
    timers: dict[str, Timer], rounds: int, calls: int, budget_s: float, min_rounds: int = MIN_ROUNDS
) -> dict[str, list[list[float]]]:
    """Per contender, the ms of its calls in each round: up to ``rounds`` rounds (at least ``min_rounds``) of a
    block of up to ``calls`` calls each, in an order rotated every round, until ``budget_s`` per contender is spent.
    A block starts with one untimed call (the other contenders' blocks cooled its caches and thread pool) and stops
    early once its share of the budget is spent (one timed call at least). A contender whose calls are too slow for
    the floor of rounds to fit :data:`OVERRUN` times its budget gets fewer (:func:`rounds_that_fit`, one at least),
    so the budget bounds the wall time whatever a call costs; how many each ran is the length of its list."""
    names = list(timers)
    out: dict[str, list[list[float]]] = {n: [] for n in names}
    caps: dict[str, int] = {}
    deadline = time.perf_counter() + budget_s * len(names)
    block_s = budget_s / max(rounds, 1)
    for r in range(max(rounds, min_rounds)):
        if r >= min_rounds and (r >= rounds or time.perf_counter() > deadline):
            break
        for name in names[r % len(names) :] + names[: r % len(names)]:
            if len(out[name]) >= caps.get(name, r + 1):
                continue
            t0 = time.perf_counter()
            timers[name](1, None)
            t1 = time.perf_counter()
            out[name].append(timers[name](calls, block_s))
            if r == 0:
                call_s = min(t1 - t0, (time.perf_counter() - t1) / max(len(out[name][0]), 1))
                caps[name] = rounds_that_fit(call_s, budget_s, min_rounds)
        if all(len(out[n]) >= caps[n] for n in names):
            break
    return out


# How far past its budget a contender's floor of rounds may run before its rounds are cut: a second-long call keeps
# its floor (its spread measured), a call of many seconds (a large model on a CPU) is not run a dozen times
OVERRUN = 10.0


def rounds_that_fit(call_s: float, budget_s: float, min_rounds: int = MIN_ROUNDS) -> int:
    """The rounds a contender whose call takes ``call_s`` seconds may run: no cap (the floor and the budget decide)
    where ``min_rounds`` rounds of two calls (the untimed one and one timed) fit :data:`OVERRUN` times
    ``budget_s``, else as many as fit that, one at least: a call of many seconds is measured once or a few times,
    not ``2 * min_rounds`` times."""
    allowed = OVERRUN * budget_s
    if 2 * call_s * min_rounds <= allowed:
        return sys.maxsize
    return max(1, int(allowed // (2 * call_s)))


# a median's 95 % interval wider than this share of it: the machine was too busy for the timing to mean much
BUSY_SPREAD = 0.25


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """A distribution-free interval for the median of ``values``: the order statistics whose binomial coverage is at
    least ``confidence`` (the outermost pair, [min, max], when there are too few values for it)."""
    xs = sorted(values)
    n = len(xs)
    if n == 0:
        return float("nan"), float("nan")
    tail = (1.0 - confidence) / 2
    k, below = 0, 0.0
    while k < n // 2:  # the largest k with P(Binomial(n, 1/2) <= k) <= tail: interval [x_(k+1), x_(n-k)]
        below += math.comb(n, k) / 2**n
        if below > tail:
            break
        k += 1
    k = max(k - 1, 0) if k else 0
    return xs[k], xs[n - 1 - k]


def paired_ratio(slow_rounds: list[float], fast_rounds: list[float], slow_p50: float, fast_p50: float) -> float:
    """``slow / fast`` as the median of their medians' ratios paired round by round, the point
    :func:`ratio_interval` brackets (a ratio of the two pooled p50s can fall outside that interval on a busy
    machine); the ratio of the p50s where there are no rounds to pair."""
    pairs = [a / b for a, b in zip(slow_rounds, fast_rounds) if b > 0]
    return float(statistics.median(pairs)) if pairs else slow_p50 / fast_p50


def ratio_interval(slow_rounds: list[float], fast_rounds: list[float]) -> tuple[float, float] | None:
    """95 % interval of ``slow / fast`` from two contenders' medians paired round by round (one load each); None
    without at least two pairs."""
    pairs = [a / b for a, b in zip(slow_rounds, fast_rounds) if b > 0]
    return median_interval(pairs) if len(pairs) >= 2 else None
