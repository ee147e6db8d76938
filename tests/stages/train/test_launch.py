"""Checks run_torchrun makes before it starts torchrun: mistakes said once, at once, not by every worker later."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from kiln.core.errors import ConfigError, KilnError
from kiln.pipeline.config import config_from_dict
from kiln.pipeline.runner import settings_for
from kiln.pipeline.stage_list import stage_named
from kiln.stages.train import launch
from kiln.stages.train.launch import check_before_launch, relay, run_torchrun
from tests.conftest import tiny_config_dict

LOG = logging.getLogger("kiln.train.test_launch")


def settings(**overrides: Any) -> Any:
    """The train stage's settings of a tiny CPU run on two processes, with ``overrides`` (dotted keys)."""
    base = {"train.distributed": {"nproc_per_node": 2}, "train.device": "cpu", **overrides}
    return settings_for(stage_named("train"), config_from_dict(tiny_config_dict(**base)))


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun must not start: a check that fails raises before it."""

    def refuse(cmd: list[str]) -> Any:
        raise AssertionError(f"torchrun was started: {cmd}")

    monkeypatch.setattr(launch, "start_launcher", refuse)


def test_code_in_the_script_is_refused_before_the_launch(tmp_path: Path, no_launch: None) -> None:
    cfg = settings(**{"model.name": "__main__:build", "model.params": {}, "data.name": "__main__:load"})
    with pytest.raises(ConfigError) as err:
        run_torchrun(cfg, tmp_path / "out", tmp_path, LOG)
    assert err.value.message == (
        "model.name '__main__:build' is defined in your script, which the torchrun workers cannot import"
    )
    assert "move build and load into a module file beside the script" in (err.value.hint or "")
    assert "'mymodels:build'" in (err.value.hint or "")


@pytest.mark.parametrize(
    ("overrides", "said"),
    [
        ({"train.batch_size": 33}, "train.batch_size 33 is not divisible by 2 processes"),
        ({"train.distributed": {"nproc_per_node": 2, "backend": "nccl"}}, "'nccl' needs CUDA"),
        ({"train.checkpoint": {"resume": "nothere/last.pt"}}, "nothere/last.pt not found"),
    ],
)
def test_config_mistakes_are_said_before_the_launch(
    tmp_path: Path, no_launch: None, overrides: dict[str, Any], said: str
) -> None:
    with pytest.raises(KilnError, match=said):
        run_torchrun(settings(**overrides), tmp_path / "out", tmp_path, LOG)


def test_more_processes_than_cores_on_cpu_is_said_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    monkeypatch.setattr(launch.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        check_before_launch(settings(**{"train.distributed": {"nproc_per_node": 4}}), tmp_path, LOG)
        check_before_launch(settings(), tmp_path, LOG)  # 2 processes on 2 cores: nothing to say
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 1 and "nproc_per_node is 4" in said[0] and "2 CPU cores" in said[0]
    assert "one thread" in said[0]


def test_a_workers_error_is_not_relayed_as_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """error.json carries a worker's error, which run_torchrun raises once."""
    with caplog.at_level(logging.DEBUG, logger=LOG.name):
        relay("[rank 0] ERROR kiln: train.batch_size 33 is not divisible by 2 processes", LOG, set())
    assert not [r for r in caplog.records if r.levelno >= logging.INFO]
