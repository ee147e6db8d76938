"""The run's times: each stage's own work apart from the cache check before it (its key, which loads and hashes
the user's data for the first stage that reads it), and the run's wall time, in the result and in the report.
A fake clock that moves only where the test says keeps the numbers exact."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kiln.pipeline import runner as runner_module
from kiln.pipeline.config import config_from_dict
from kiln.pipeline.report import build_report, render_markdown
from kiln.pipeline.runner import Runner, RunResult, StageRecord
from tests.conftest import tiny_config_dict
from tests.pipeline import fake_stages

CHECK, WORK = 5.0, 1.0  # fake seconds each stage's key and each stage's work take


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(runner_module, "time", clock)
    key, write = runner_module.cache_key, fake_stages._write

    def slow_key(*args: Any, **kwargs: Any) -> Any:
        clock.now += CHECK
        return key(*args, **kwargs)

    def slow_write(*args: Any) -> None:
        clock.now += WORK
        write(*args)

    monkeypatch.setattr(runner_module, "cache_key", slow_key)
    monkeypatch.setattr(fake_stages, "_write", slow_write)
    return clock


def _run(workdir: Path) -> runner_module.RunResult:
    cfg = config_from_dict(tiny_config_dict(**{"seed": 1, "train.epochs": 2, "optimize.rounds": 1}))
    return Runner(cfg, workdir, fake_stages.fake_stages()).run()


def test_a_stage_that_runs_is_timed_apart_from_its_check(tmp_path: Path, clock: Clock) -> None:
    result = _run(tmp_path)
    assert [(r.status, r.seconds, r.check_seconds) for r in result.records] == [("ran", WORK, CHECK)] * 3
    assert result.wall_seconds == 3 * (CHECK + WORK) and result.check_seconds == 3 * CHECK


def test_a_cached_stage_is_not_charged_its_check(tmp_path: Path, clock: Clock) -> None:
    _run(tmp_path)
    again = _run(tmp_path)
    assert [(r.status, r.seconds, r.check_seconds) for r in again.records] == [("cached", 0.0, CHECK)] * 3
    assert all(r.original_seconds == WORK for r in again.records)
    assert again.wall_seconds == 3 * CHECK


def test_the_report_gives_the_checks_and_the_wall_time(tmp_path: Path) -> None:
    records = [
        StageRecord("train", "cached", 0.0, original_seconds=2.0, check_seconds=8.5),
        StageRecord("export", "ran", 3.0, check_seconds=0.25),
    ]
    report = build_report(RunResult(tmp_path, records, wall_seconds=12.0), config_from_dict(tiny_config_dict()))
    assert report["wall_seconds"] == 12.0 and report["check_seconds"] == 8.75
    train = report["stages"]["train"]
    assert (train["seconds"], train["original_seconds"], train["check_seconds"]) == (0.0, 2.0, 8.5)
    md = render_markdown(report)
    assert "| train | cached | 0.00 (ran in 2.00) |" in md and "| export | ran | 3.00 |" in md
    assert "Run: 12.00 s wall time, of which 8.75 s deciding which stages are cached" in md
