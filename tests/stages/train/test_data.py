"""The loader's batches: settings that do nothing are said, and no batch of one row reaches BatchNorm unsaid."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch import nn

from kiln.stages.train.data import make_loader, micro_batches
from kiln.stages.train.dist import DistEnv
from tests.stages.train.train_helpers import tiny_data, train_cfg

CPU = torch.device("cpu")


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "kiln.train"]


@pytest.mark.parametrize(
    ("loader", "said"),
    [
        ({"persistent_workers": True}, "persistent_workers (num_workers is 0"),
        ({"prefetch_factor": 4}, "prefetch_factor (num_workers is 0"),
        ({"pin_memory": True}, "pin_memory (training runs on the CPU"),
        ({"on_device": True}, "on_device (training runs on the CPU"),
    ],
)
def test_a_loader_setting_that_does_nothing_is_said(
    caplog: pytest.LogCaptureFixture, loader: dict[str, Any], said: str
) -> None:
    data = tiny_data()
    with caplog.at_level(logging.WARNING, logger="kiln.train"):
        make_loader(data.train_x, data.train_y, train_cfg(loader=loader), DistEnv(), seed=0, device=CPU)
    found = warnings_of(caplog)
    assert len(found) == 1 and found[0].startswith("train.loader settings ignored: ") and said in found[0]


def test_a_last_batch_of_one_row_is_said_with_a_batch_size_that_avoids_it(caplog: pytest.LogCaptureFixture) -> None:
    x, y = torch.randn(375, 16), torch.randint(0, 4, (375,))  # 188 rows per process, 17 per batch: 11 x 17 + 1
    with caplog.at_level(logging.WARNING, logger="kiln.train"):
        make_loader(x, y, train_cfg(batch_size=34), DistEnv(0, 2, 0), seed=0, device=CPU)
    found = [m for m in warnings_of(caplog) if "last batch" in m]
    assert found == [
        "the epoch's last batch on each process has 1 row (188 rows per process, 17 per batch): BatchNorm cannot "
        "train on one row, and the step weighs it like a full batch; change train.batch_size (e.g. 32)"
    ]


def test_no_micro_batch_of_one_row_reaches_batchnorm() -> None:
    """A batch of 7 rows in 3 micro-batches: 3, 3 and 1 row, whose last BatchNorm cannot train on."""
    bn = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8)).train()
    x, y = torch.randn(7, 4), torch.arange(7)
    chunks = micro_batches(x, y, 3)
    assert [len(cy) for _, cy in chunks] == [3, 4]
    assert torch.equal(torch.cat([cx for cx, _ in chunks]), x) and torch.equal(torch.cat([cy for _, cy in chunks]), y)
    for cx, _ in chunks:
        bn(cx)
    assert [len(cy) for _, cy in micro_batches(x[:3], y[:3], 3)] == [1, 1, 1]  # one row each by design: kept
