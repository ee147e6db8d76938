"""Training any task: cross-entropy on the named logits output, MSE for float targets, or the user's loss."""
from __future__ import annotations

import pytest
import torch
from kiln.core.errors import ConfigError, ModelError
from kiln.models.datasets import synthetic_regression, synthetic_text
from kiln.models.registry import build_model
from kiln.stages.train.config import TrainConfig
from kiln.stages.train.loop import train
from kiln.stages.train.task import Task, check_task, task_for

CFG = TrainConfig(epochs=3, batch_size=32, device="cpu", plot=False, grad_accum_steps=2)


def test_user_loss_by_import_path_trains_a_regression() -> None:
    data = synthetic_regression(size=256)
    task = task_for(data, "torch.nn.functional:smooth_l1_loss", None)
    assert task.user_loss is torch.nn.functional.smooth_l1_loss and task.kind == "regression"
    model = build_model("mlp_regressor")
    result = train(model, data, CFG, task=task)
    losses = [m.loss for m in result.history]
    assert losses[-1] < losses[0] and result.history[-1].val_accuracy is None


def test_cross_entropy_on_the_named_output_of_a_dict_input_model() -> None:
    data = synthetic_text(size=256)
    model = build_model("token_classifier", {"dim": 16, "layers": 1})
    result = train(model, data, CFG, task=task_for(data, None, "output_1"))
    assert result.history[-1].val_accuracy is not None and result.history[-1].loss < result.history[0].loss


def test_task_mismatches_are_clear_errors() -> None:
    out, y = torch.zeros(2, 3), torch.zeros(2, 1)
    with pytest.raises(ModelError, match="mean squared error needs the same shape"):
        check_task(Task("regression"), out, y, 0, "m")
    with pytest.raises(ConfigError, match="which is the class-logit output"):
        check_task(Task("classification"), (out, out), torch.zeros(2, dtype=torch.long), 3, "m")
    with pytest.raises(ConfigError, match="train.loss failed on the model's outputs"):
        check_task(Task("custom", user_loss=lambda o, t: o.missing), out, y, 0, "m")
