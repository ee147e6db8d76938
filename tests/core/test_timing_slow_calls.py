"""Interleaved timing of a contender whose calls outlast the time budget: the budget bounds its calls."""

from __future__ import annotations

import pytest

from kiln.core import timing


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [0.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])
    return now


def _timer(clock: list[float], call_s: float, made: list[int]) -> timing.Timer:
    """A fake timer whose every call takes ``call_s`` seconds of ``clock``, counting them in ``made``."""

    def run(calls: int, budget_s: float | None) -> list[float]:
        times: list[float] = []
        deadline = clock[0] + budget_s if budget_s is not None else float("inf")
        for _ in range(calls):
            if times and clock[0] > deadline:
                break
            clock[0] += call_s
            made.append(1)
            times.append(call_s * 1e3)
        return times

    return run


def test_a_call_past_the_budget_is_measured_once_not_for_every_round(clock: list[float]) -> None:
    slow: list[int] = []
    fast: list[int] = []
    out = timing.interleave({"slow": _timer(clock, 9.0, slow), "fast": _timer(clock, 0.01, fast)}, 6, 20, 3.0)
    assert out["slow"] == [[9000.0]]  # one round: its untimed call and one timed
    assert len(slow) == 2
    assert len(out["fast"]) == timing.MIN_ROUNDS  # the floor of rounds stays for calls well under the budget


def test_calls_of_seconds_run_the_rounds_that_fit_the_overrun(clock: list[float]) -> None:
    """0.5 s calls keep the floor of rounds (6 rounds of two calls: 6 s, within 10 times the 3 s budget); 5 s calls
    run the 3 rounds that fit 30 s."""
    made: list[int] = []
    assert len(timing.interleave({"a": _timer(clock, 0.5, made)}, 6, 20, 3.0)["a"]) == timing.MIN_ROUNDS
    clock[0] = 0.0
    out = timing.interleave({"a": _timer(clock, 5.0, made)}, 6, 20, 3.0)
    assert len(out["a"]) == 3 and clock[0] <= timing.OVERRUN * 3.0


def test_a_slow_first_call_alone_does_not_cut_a_fast_contenders_rounds(clock: list[float]) -> None:
    made: list[int] = []
    fast = _timer(clock, 0.01, made)
    first = [True]

    def compiles_first(calls: int, budget_s: float | None) -> list[float]:
        if first[0]:  # a lazy compile in its first call
            first[0] = False
            clock[0] += 30.0
        return fast(calls, budget_s)

    assert len(timing.interleave({"a": compiles_first}, 6, 5, 3.0)["a"]) == timing.MIN_ROUNDS


def test_rounds_that_fit_keeps_the_floor_where_it_fits() -> None:
    assert timing.rounds_that_fit(1.0, 3.0) > timing.MIN_ROUNDS
    assert timing.rounds_that_fit(9.0, 3.0) == 1
    assert timing.rounds_that_fit(100.0, 3.0) == 1
