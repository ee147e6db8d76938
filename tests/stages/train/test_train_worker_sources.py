"""A worker started by hand (no ``--sources``) resumes only a checkpoint trained from the same code and data."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from kiln.stages.train.worker import main

MODULE = """
from pathlib import Path

import torch
from torch import nn

from kiln import DatasetSplits

HERE = Path(__file__).parent
calls = [0]


def build() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def load() -> DatasetSplits:
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    y = (x[:, int((HERE / "label_column.txt").read_text())] > 0).long()
    return DatasetSplits(x[:48], y[:48], x[48:], y[48:], num_classes=2)


def loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    calls[0] += torch.is_grad_enabled()  # training steps only
    stop = HERE / "stop_after.txt"
    if stop.exists() and calls[0] > int(stop.read_text()):
        raise ValueError("stopped on purpose")
    return nn.functional.cross_entropy(outputs, targets)
"""


def test_a_hand_started_worker_does_not_resume_a_checkpoint_of_other_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "handrun.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = tmp_path / "run.yaml"
    config.write_text(
        "model: {name: 'handrun:build'}\ndata: {name: 'handrun:load'}\n"
        "train: {epochs: 2, batch_size: 16, device: cpu, loss: 'handrun:loss'}\n"
    )
    (tmp_path / "label_column.txt").write_text("0")
    (tmp_path / "stop_after.txt").write_text("4")  # 3 steps an epoch: stops in epoch 2, after epoch 1's checkpoint
    argv = ["--config", str(config), "--out", str(tmp_path / "out"), "--checkpoint-dir", str(tmp_path / "ck")]
    assert main(argv) != 0
    assert json.loads((tmp_path / "ck" / "last.json").read_text())["complete"] is False
    (tmp_path / "stop_after.txt").unlink()
    (tmp_path / "label_column.txt").write_text("1")  # other labels from the same code
    with caplog.at_level(logging.WARNING, logger="kiln.train"):
        assert main(argv) == 0
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["resumed_from"] is None
    assert "the data (dataset) changed since it was written; training afresh" in caplog.text
