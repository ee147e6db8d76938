"""The sizes a dynamic axis takes, as steps ``[period, *residues]`` (:func:`kiln.core.records.takes_size`), found
from runs of a graph at chosen sizes: shared by the export's probe of the graph it wrote and the build's probe of
the graph it builds, so both record a period only where they saw it repeat."""

from __future__ import annotations

import math
from collections.abc import Callable

# The period of steps that list the sizes they take (:func:`listed_steps`): past any size an axis is given
LISTED_PERIOD = 1 << 16


def listed_steps(sizes: list[int]) -> list[int]:
    """Steps that take ``sizes`` alone (``[65536, 64, 96]``: 64 and 96), where no period of theirs was seen
    repeat: a period longer than any of them, each residue a size itself."""
    return [max(LISTED_PERIOD, max(sizes, default=0) + 1), *sorted(set(sizes))]


def sparse_steps(seen: Callable[[int], bool], ok: dict[int, bool], low: int, top: int) -> list[int] | None:
    """The steps of the sizes from ``low`` to ``top`` that ran (``ok``: each of them tried), probed whole with no
    period repeating twice inside: one step between them (their greatest common divisor) where every size on it
    inside runs and the next past ``top`` does too (``seen`` runs it), since two sizes alone would invent a
    period (64 and 96 are no steps of 33); else those sizes listed (:func:`listed_steps`). None where none ran."""
    taken = [size for size in range(low, top + 1) if ok[size]]
    if not taken:
        return None
    step = math.gcd(*(size - taken[0] for size in taken[1:]))
    if step > 1:
        on = range(low + (taken[0] - low) % step, top + 1, step)
        if all(ok[size] for size in on) and seen(taken[-1] + step):
            return [step, taken[0] % step]
    return listed_steps(taken)


def aligned_period(
    seen: Callable[[int], bool], ok: dict[int, bool], low: int, top: int, every: bool = False
) -> int | None:
    """The smallest power of two ``p`` such that the graph runs at the sizes ``low + k p`` only (``ok``: the sizes
    tried, ``low`` among them), checked at the sizes tried, one period on, the sizes either side of it, and two
    periods on, past ``top`` where the range holds less (two sizes alone make no period); with ``every``, at each
    ``low + k p`` up to ``top`` and at every size of the two whole periods from ``low`` too, since a size off that
    grid which runs (a model taking multiples of 8 or of 12) would be refused unseen. None where none is."""
    period = 2
    while low + period <= top:
        if all(ok[s] == ((s - low) % period == 0) for s in ok) and all(
            seen(s) == ((s - low) % period == 0) for s in _period_checks(low, top, period, every)
        ):
            return period
        period *= 2
    return None


def _period_checks(low: int, top: int, period: int, every: bool) -> list[int]:
    """The sizes :func:`aligned_period` runs to hold ``period`` from ``low`` (``top``: the range's end): the cheap
    ones first (one period on, either side of it, two periods on), so that a wrong period costs few runs; with
    ``every``, then each size on its grid up to ``top`` and each size of its two whole periods from ``low``."""
    checks = [low + period, low + period - 1, low + period + 1, low + 2 * period]
    checks = [s for s in checks if s <= top or s == checks[-1]]
    if every:
        checks += [*range(low, top + 1, period), *range(low, min(top, low + 2 * period) + 1)]
    return checks
