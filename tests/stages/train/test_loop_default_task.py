"""The loss a training run uses when it is given none: cross-entropy, a Task of the run's own."""

from __future__ import annotations

import torch

from kiln.stages.train.dist import DistEnv
from kiln.stages.train.loop import _Trainer
from tests.stages.train.train_helpers import tiny_data, tiny_net, train_cfg


def _trainer() -> _Trainer:
    cpu = torch.device("cpu")
    return _Trainer(tiny_net(), tiny_data(40), train_cfg(epochs=1), 0, DistEnv(), cpu, "fp32", None, "", None)


def test_runs_given_no_task_do_not_share_one() -> None:
    """A Task records what it checked during a run (``checked``, ``batch_wide_at``): a default shared by every run
    would carry one run's records into the next."""
    first, second = _trainer(), _trainer()
    assert first.task.kind == second.task.kind == "classification"
    assert first.task is not second.task
