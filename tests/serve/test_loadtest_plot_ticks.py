"""loadtest.png's concurrency axis: ticked at the levels, labelled as plain numbers, whatever their range."""

from __future__ import annotations

from typing import Any

import matplotlib
import pytest

from kiln.serve.loadtest import plot


def _level(c: int) -> dict[str, Any]:
    return {"concurrency": c, "throughput_rps": 100.0 * c, "latency_ms": {"p50": 1.0, "p90": 2.0, "p99": 3.0}}


def test_the_concurrency_axis_names_each_level_and_nothing_else(monkeypatch: pytest.MonkeyPatch) -> None:
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn: list[Any] = []
    close = plt.close
    monkeypatch.setattr(plt, "close", drawn.append)  # the figure plot() made, kept to read its axes back
    plot({"model": "m", "engine": "e", "levels": [_level(c) for c in (1, 4, 8)]})
    (fig,) = drawn
    try:
        for axes in fig.axes:
            shown = [t.get_text() for t in axes.get_xticklabels(which="both") if t.get_text()]
            assert shown == ["1", "4", "8"], shown
    finally:
        close(fig)
