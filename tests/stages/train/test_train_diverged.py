"""A learning rate that blows the weights up is said as such: weights that answer every held-out row with NaN fail
the run and are never checkpointed; a training loss that never gets below chance level is said to have learned
nothing (not blamed on eval mode); a batch larger than the training split and a sync_batchnorm that does nothing are
warned of."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from kiln.core.errors import TrainingError
from kiln.stages.train.config import DistributedConfig
from kiln.stages.train.dist import DistEnv, wrap_ddp
from kiln.stages.train.loop import nonfinite_rows, train
from kiln.stages.train.metrics import EpochMetrics, TrainResult
from kiln.stages.train.stage import warn_at_chance, warn_learned_nothing_held_out
from tests.stages.train.train_helpers import bn_net, tiny_data, tiny_net, train_cfg


def test_weights_blown_up_by_the_learning_rate_fail_the_run_without_a_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kiln.train"), pytest.raises(TrainingError) as caught:
        train(bn_net(), tiny_data(), train_cfg(epochs=3, lr=1e30, optimizer="adamw", grad_clip=None), ckpt_dir=tmp_path)
    said = str(caught.value)
    assert "training diverged at step 2: the weights give no finite output on 40 of the 40 held-out rows" in said
    assert "lower train.lr" in caught.value.hint and "no checkpoint of finite outputs" in caught.value.hint
    assert not (tmp_path / "last.pt").exists()  # never a "last good checkpoint" of NaN outputs
    logged = " ".join(caplog.messages)
    assert "an update blew them up" in logged and "attention" not in logged
    assert "learned from 1 step only" in logged


def test_an_abort_after_the_blow_up_says_the_weights_diverged(tmp_path: Path) -> None:
    cfg = train_cfg(epochs=8, lr=1e30, optimizer="adamw", grad_clip=None, amp={"nonfinite_patience": 6})
    with pytest.raises(TrainingError, match="training diverged at step 2") as caught:
        train(bn_net(), tiny_data(), cfg, ckpt_dir=tmp_path)
    assert "last good checkpoint" not in str(caught.value) and "resume" not in caught.value.hint


class NanOnNegative(nn.Module):
    """A classifier whose forward makes NaN on the rows whose first pixel is below ``cut`` (a masked row)."""

    def __init__(self, cut: float) -> None:
        super().__init__()
        self.cut = cut
        self.net = tiny_net()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        return torch.where(x[:, :1, 0, 0] < self.cut, float("nan"), out)


def test_nonfinite_rows_counts_the_rows_answered_with_nan() -> None:
    x = torch.zeros(10, 1, 8, 8)
    x[:3, 0, 0, 0] = -1.0
    assert nonfinite_rows(NanOnNegative(0.0), x, torch.device("cpu"), batch=4) == (3, 10)


def test_a_forward_that_makes_nan_on_a_few_rows_is_warned_of_not_failed(caplog: pytest.LogCaptureFixture) -> None:
    data = tiny_data()
    cut = float(data.val_x[:, 0, 0, 0].sort().values[2])  # two held-out rows below it; training rows alike
    with caplog.at_level(logging.WARNING, logger="kiln.train"):
        result = train(NanOnNegative(cut), data, train_cfg(epochs=1))
    assert math.isnan(result.history[-1].val_loss)
    said = " ".join(caplog.messages)
    assert "the model answers 2 of the 40 held-out rows with NaN or infinity" in said and "attention" in said


def _curve(losses: list[float], accuracies: list[float], val_loss: float = 1.0) -> list[EpochMetrics]:
    return [
        EpochMetrics(i + 1, loss, 1.0, 8, 1e-3, val_loss=val_loss, val_accuracy=acc)
        for i, (loss, acc) in enumerate(zip(losses, accuracies))
    ]


def test_a_training_loss_that_never_got_below_chance_is_said_to_have_learned_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="kiln.train"):
        assert warn_learned_nothing_held_out(_curve([169.0, 12.0, 5.38], [0.141, 0.094, 0.125]), math.log(10))
    said = " ".join(caplog.messages)
    assert "never below the 2.303 of answering at chance" in said and "lower train.lr" in said, said
    assert "by epoch: 0.141, 0.094, 0.125" in said and "stayed at" not in said
    assert "model.eval()" not in said


def test_a_final_training_loss_above_chance_is_warned_of_whatever_the_accuracy(
    caplog: pytest.LogCaptureFixture,
) -> None:
    result = TrainResult(history=_curve([3.12, 2.76, 2.44], [0.125, 0.15, 0.1875], val_loss=2.309))
    with caplog.at_level(logging.WARNING, logger="kiln.train"):
        warn_at_chance(result, 10, math.log(10))
    said = " ".join(caplog.messages)
    assert "final training loss 2.44, not below the ln(10) = 2.303 of uniform scores, validation loss 2.309" in said
    assert "lower train.lr" in said, said


def test_a_batch_larger_than_the_training_split_is_warned_of(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kiln.train"):
        result = train(tiny_net(), tiny_data(), train_cfg(epochs=1, batch_size=512))
    assert result.history[-1].steps == 1
    said = [m for m in caplog.messages if "larger than the 160 training rows" in m]
    assert len(said) == 1 and "train.batch_size 512" in said[0], caplog.messages


def test_sync_batchnorm_on_one_process_is_warned_of(caplog: pytest.LogCaptureFixture) -> None:
    model = bn_net()
    with caplog.at_level(logging.WARNING, logger="kiln.train"):
        assert wrap_ddp(model, DistEnv(), DistributedConfig(sync_batchnorm=True), torch.device("cpu")) is model
    assert any("sync_batchnorm ignored: one process trains" in m for m in caplog.messages)
