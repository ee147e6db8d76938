"""The timing helpers' budgets, on a fake clock (each call of the timed function takes one second of it)."""

from __future__ import annotations

import pytest

from kiln.core import timing


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [0.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])
    return now


def test_a_budget_cuts_timed_calls_but_keeps_three(clock: list[float]) -> None:
    calls = []

    def one_second() -> None:
        calls.append(1)
        clock[0] += 1.0

    assert timing.time_calls(one_second, 30, cuda=False, budget_s=5.0) == [1000.0] * 6
    calls.clear()
    assert len(timing.time_calls(one_second, 30, cuda=False, budget_s=0.5)) == timing.MIN_TIMED
    assert len(timing.time_calls(one_second, 30, cuda=False)) == 30


def test_warm_up_stops_after_a_quarter_of_the_budget_but_runs_once(clock: list[float]) -> None:
    calls = []

    def one_second() -> None:
        calls.append(1)
        clock[0] += 1.0

    timing.warm_up(one_second, 10, budget_s=8.0)  # 2 s is a quarter: calls at t=0, 1, 2 start, t=3 does not
    assert len(calls) == 3
    calls.clear()
    timing.warm_up(one_second, 10, budget_s=0.1)
    assert len(calls) == 1
    calls.clear()
    timing.warm_up(one_second, 10)
    assert len(calls) == 10


def test_median_interval_covers_the_median_with_the_binomial_ranks() -> None:
    from kiln.core.timing import median_interval

    assert median_interval([3.0, 1.0, 2.0, 5.0, 4.0, 6.0]) == (1.0, 6.0)  # six values: [min, max] is 96.9 %
    assert median_interval([float(i) for i in range(10)]) == (1.0, 8.0)
    assert median_interval([float(i) for i in range(20)]) == (5.0, 14.0)


def test_interleave_rotates_and_gives_every_contender_the_same_rounds() -> None:
    from kiln.core.timing import MIN_ROUNDS, interleave

    order: list[str] = []

    def timer(name: str):
        def run(calls: int, budget_s: float | None) -> list[float]:
            order.append(name)
            return [1.0] * calls

        return run

    out = interleave({"a": timer("a"), "b": timer("b"), "c": timer("c")}, rounds=3, calls=2, budget_s=10.0)
    assert all(len(r) == MIN_ROUNDS and all(len(block) == 2 for block in r) for r in out.values())
    assert order[:12:2] == ["a", "b", "c", "b", "c", "a"]  # each round starts one later...
    assert order[1::2] == order[::2]  # ...and each block with an untimed call of its own


def test_a_paired_ratio_is_the_middle_of_the_per_round_ratios_its_interval_brackets() -> None:
    from kiln.core.timing import paired_ratio, ratio_interval

    slow = [1.0, 1.1, 1.0, 1.2, 1.0, 1.1, 1.0, 1.05]
    fast = [0.5, 0.6, 0.5, 1.5, 0.55, 0.5, 0.6, 0.5]  # one round under load
    ratio = paired_ratio(slow, fast, slow_p50=1.05, fast_p50=1.4)  # pooled p50s a busy machine skewed: 0.75x
    low, high = ratio_interval(slow, fast)
    assert low <= ratio <= high and ratio == pytest.approx(1.95, abs=0.05)
    assert paired_ratio([], [], 2.0, 1.0) == 2.0  # no rounds to pair: the p50s
