"""What a skipped step or a NaN validation loss is said to be: an fp16 overflow of a fixed loss scale, the user's
loss rather than the model, and a run whose steps were mostly skipped."""

from __future__ import annotations

import logging

import pytest
import torch

from kiln.core.errors import TrainingError
from kiln.stages.train.loop import train
from kiln.stages.train.task import task_for
from tests.stages.train.train_helpers import tiny_data, tiny_net, train_cfg

_calls = [0]


def nan_on_validation(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A train.loss that is NaN whenever no gradient is taken (the validation loss), finite otherwise."""
    loss = torch.nn.functional.cross_entropy(outputs, targets)
    return loss if torch.is_grad_enabled() else loss * float("nan")


def nan_after_three(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A train.loss whose training steps turn NaN after the third."""
    _calls[0] += torch.is_grad_enabled()
    loss = torch.nn.functional.cross_entropy(outputs, targets)
    return loss * float("nan") if _calls[0] > 3 else loss


def test_an_overflowing_fixed_fp16_loss_scale_is_said_as_an_overflow(caplog: pytest.LogCaptureFixture) -> None:
    cfg = train_cfg(precision="fp16", epochs=2, amp={"loss_scale": 1e30, "nonfinite_patience": 4})
    with caplog.at_level(logging.WARNING, logger="kiln.train"), pytest.raises(TrainingError) as err:
        train(tiny_net(), tiny_data(), cfg)
    assert "with the fixed loss scale 1e+30" in str(err.value)
    assert err.value.hint.startswith("lower train.amp.loss_scale or use train.amp.loss_scale: dynamic")
    assert "not an fp16 overflow" not in caplog.text


def test_fixed_scale_overflows_are_counted_as_fp16_overflows() -> None:
    cfg = train_cfg(precision="fp16", epochs=1, amp={"loss_scale": 1e30, "nonfinite_patience": 100})
    result = train(tiny_net(), tiny_data(), cfg)
    assert result.history[0].skipped_steps == result.history[0].steps and result.history[0].nonfinite_steps == 0


def test_a_nan_validation_loss_of_finite_outputs_names_train_loss(caplog: pytest.LogCaptureFixture) -> None:
    cfg, data = train_cfg(epochs=1, loss=f"{__name__}:nan_on_validation"), tiny_data()
    with caplog.at_level(logging.WARNING, logger="kiln.train"):
        train(tiny_net(), data, cfg, task=task_for(data, cfg.loss, None))
    assert f"train.loss {__name__}:nan_on_validation returns NaN or infinity" in caplog.text
    assert "the model answers some held-out samples with NaN" not in caplog.text


def test_a_run_whose_steps_were_mostly_skipped_says_how_many(caplog: pytest.LogCaptureFixture) -> None:
    _calls[0] = 0
    cfg, data = train_cfg(epochs=2, loss=f"{__name__}:nan_after_three", amp={"nonfinite_patience": 1000}), tiny_data()
    with caplog.at_level(logging.WARNING, logger="kiln.train"):
        result = train(tiny_net(), data, cfg, task=task_for(data, cfg.loss, None))
    planned = sum(m.steps for m in result.history)
    assert f"{planned - 3} of the run's {planned} training steps were skipped" in caplog.text


class _NanGrad(torch.autograd.Function):
    """Identity forward, NaN backward: gradients non-finite on a finite loss, as a reduced-precision kernel's."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("nan")


class _NanGradNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = tiny_net()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _NanGrad.apply(self.net(x))


def test_nan_gradients_from_the_first_step_lead_with_fp32_not_a_last_good_checkpoint(tmp_path) -> None:
    """Every step skipped from step 1 on a finite loss: the error named last.pt of the initial weights as the "last
    good checkpoint" and led with lowering the learning rate."""
    cfg = train_cfg(precision="bf16", epochs=1, amp={"nonfinite_patience": 3}, checkpoint={"every_steps": 1})
    with pytest.raises(TrainingError) as err:
        train(_NanGradNet(), tiny_data(), cfg, ckpt_dir=tmp_path)
    assert "no step updated the weights" in err.value.message and "last good checkpoint" not in err.value.message
    assert err.value.hint.startswith("try train.precision: fp32")
