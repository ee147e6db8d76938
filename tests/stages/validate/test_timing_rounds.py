"""The timing record says how many interleaved rounds ran: at least six (the fewest that give a 95 % interval of the
median), so ``validate.rounds: 3`` records six, not the three asked for."""

from __future__ import annotations

from types import SimpleNamespace

from kiln.core.progress import SilentProgress
from kiln.stages.validate.config import ValidateConfig
from kiln.stages.validate.stage import time_interleaved


def _timer(calls: int, budget_s: float | None) -> list[float]:
    return [0.01] * calls  # ms per call: no real work, the rounds are what is counted


def test_the_rounds_recorded_are_those_run() -> None:
    cfg = ValidateConfig(rounds=3, iterations=2, time_budget_s=0.05)
    ctx = SimpleNamespace(progress=SilentProgress())
    out, info = time_interleaved({"a": {1: _timer}, "b": {1: _timer}}, [1], cfg, ctx)
    assert len(out["a"]["1"].rounds) == 6 and info["rounds"] == 6
