"""Latency figures from interleaved rounds (:func:`kiln.stages.validate.baselines.from_rounds`)."""

from __future__ import annotations

import statistics

from kiln.core.timing import median_interval
from kiln.stages.validate.baselines import from_rounds


def test_the_p50_lies_in_its_own_95_percent_interval() -> None:
    """Twelve rounds of five calls, two of them on a loaded machine: each round's median is near 0.30 ms but its
    calls scatter around it, fast ones at 0.29 and slow ones at 0.40, and the loaded rounds run every call at 0.40.
    The median of all 60 calls (0.352) lies above the interval from the rounds' medians ([0.301, 0.3045]): the p50
    reported is the statistic that interval is of, the median of the rounds' medians."""
    medians = [0.300 + 0.0005 * i for i in range(10)]
    rounds = [[0.29, 0.29, m, 0.40, 0.40] for m in medians] + [[0.40] * 5, [0.40] * 5]
    p = from_rounds(rounds)
    assert statistics.median([t for r in rounds for t in r]) > p.ci95[1]  # what p50 used to be: outside it
    assert p.ci95 == median_interval([*medians, 0.40, 0.40]) and p.ci95[0] <= p.p50 <= p.ci95[1]
    assert p.p50 == statistics.median([*medians, 0.40, 0.40]) and p.rounds == [*medians, 0.40, 0.40]
    assert p.p50 <= p.p90 <= p.p99 and p.spread == (p.ci95[1] - p.ci95[0]) / p.p50


def test_rounds_of_one_call_each_still_give_ordered_percentiles() -> None:
    """A slow contender whose budget allows one call a round: p50, p90 and p99 are of the same values, in order."""
    p = from_rounds([[5.0], [1.0], [3.0], [2.0], [4.0], [6.0]])
    assert (p.p50, p.ci95) == (3.5, (1.0, 6.0)) and p.p50 <= p.p90 <= p.p99
