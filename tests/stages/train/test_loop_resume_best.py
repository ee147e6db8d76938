"""Resuming a run whose best.safetensors is gone: the warning about select: best only where the run selects best."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from kiln.stages.train.dist import DistEnv
from kiln.stages.train.loop import _Trainer
from kiln.stages.train.metrics import TrainResult


def _resumed(tmp_path: Path, select: str) -> SimpleNamespace:
    """What _adopt_best reads of a trainer that resumed a run whose best epoch was 1 (no best.safetensors left)."""
    result = TrainResult(precision="fp32", device="cpu", best_epoch=1, best_val_accuracy=0.5, best_by="val_accuracy")
    cfg = SimpleNamespace(checkpoint=SimpleNamespace(select=select))
    return SimpleNamespace(result=result, best_digest="0" * 64, ckpt_dir=tmp_path / "run", env=DistEnv(), cfg=cfg)


@pytest.mark.parametrize("select, warned", [("last", False), ("best", True)])
def test_missing_best_weights_warn_only_under_select_best(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, select: str, warned: bool
) -> None:
    trainer = _resumed(tmp_path, select)
    with caplog.at_level(logging.WARNING, logger="kiln.train"):
        _Trainer._adopt_best(trainer, tmp_path / "old" / "last.pt")  # type: ignore[arg-type]
    assert ("select: best now chooses" in caplog.text) is warned
    r = trainer.result
    assert r.best_epoch is None and r.best_val_accuracy is None and r.best_by is None  # cleared either way
