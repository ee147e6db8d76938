"""A loss taken from torch as train.loss (``torch.nn.functional:binary_cross_entropy_with_logits``, which Kiln
recommends for multi-hot labels) reads the output Kiln scores where the model returns a dict, a ModelOutput or a
tuple; a function of the user's keeps the whole output."""

from __future__ import annotations

import functools
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from kiln.core.data import DatasetSplits
from kiln.core.errors import ConfigError
from kiln.core.user_errors import UserCodeError
from kiln.stages.train.config import TrainConfig
from kiln.stages.train.loop import train
from kiln.stages.train.stage import check_model_fits_data
from kiln.stages.train.task import Task, check_task, from_torch, task_for

BCE = "torch.nn.functional:binary_cross_entropy_with_logits"
CFG = TrainConfig(epochs=2, batch_size=16, device="cpu", plot=False, precision="fp32")


class DictTagger(nn.Module):
    """Multi-label scores as a dict beside a feature output, as a Hugging Face model returns them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = torch.tanh(self.body(x))
        return {"logits": self.head(hidden), "hidden_states": hidden}


class TwoHeads(nn.Module):
    """Two unnamed outputs: which one a loss reads is not Kiln's to guess."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 3), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a(x), self.b(x)


def _multi_hot(size: int = 64) -> DatasetSplits:
    """Float 0/1 targets [N, 3] (each label: one feature above 0)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(size, 6, generator=g)
    y = (x[:, :3] > 0).float()
    return DatasetSplits(x[:48], y[:48], x[48:], y[48:], num_classes=3)


def test_a_torch_loss_reads_the_logits_of_a_model_returning_a_dict() -> None:
    """torch's loss is given the dict's logits, not the dict, in the check before training and in training."""
    data = _multi_hot()
    task = task_for(data, BCE, None)
    check_model_fits_data(DictTagger(), data, "m:build", task)
    result = train(DictTagger(), data, CFG, task=task)
    assert result.history[-1].loss < result.history[0].loss
    out = DictTagger()(data.val_x)
    want = nn.functional.binary_cross_entropy_with_logits(out["logits"], data.val_y)
    assert torch.equal(task.loss(out, data.val_y), want)


def test_a_tiny_roberta_multi_label_classifier_trains_with_the_recommended_loss() -> None:
    """A transformers model returns a ModelOutput: torch's loss is given its logits."""
    transformers = pytest.importorskip("transformers")
    config = transformers.RobertaConfig(
        vocab_size=32,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        num_labels=3,
        problem_type="multi_label_classification",
    )
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 32, (40, 8), generator=g)
    x, y = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, (ids[:, :3] % 2).float()
    data = DatasetSplits(
        {k: v[:32] for k, v in x.items()}, y[:32], {k: v[32:] for k, v in x.items()}, y[32:], num_classes=3
    )
    task = task_for(data, BCE, None)
    torch.manual_seed(0)
    model = transformers.RobertaForSequenceClassification(config)
    check_model_fits_data(model, data, "roberta:build", task)
    result = train(model, data, CFG.model_copy(update={"epochs": 1}), task=task)
    assert result.history[-1].loss > 0 and result.history[-1].val_loss is not None


def test_the_users_own_loss_keeps_the_whole_output() -> None:
    """train.loss's documented contract: a function of the user's takes the model's outputs as forward returns
    them."""
    seen: list[Any] = []

    def own(outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        seen.append(outputs)
        return nn.functional.binary_cross_entropy_with_logits(outputs["logits"], targets)

    out = DictTagger()(torch.randn(2, 6))
    Task("regression", None, own).loss(out, torch.zeros(2, 3))
    assert seen == [out]


def test_a_loss_failing_on_the_whole_output_is_told_how_to_wrap_it() -> None:
    """A function of the user's that fails on a dict output is shown a wrapper reading the dict's logits."""

    def naive(outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.binary_cross_entropy_with_logits(outputs, targets)

    with pytest.raises(UserCodeError, match="raised AttributeError") as err:
        check_task(Task("regression", None, naive), DictTagger()(torch.randn(2, 6)), torch.zeros(2, 3), 3, "m")
    assert "wrap this one in a function of your own" in err.value.hint
    assert "def wrapped_naive(outputs, targets): return naive(outputs['logits'], targets)" in err.value.hint


def test_a_torch_loss_beside_several_unnamed_outputs_asks_which_it_reads() -> None:
    task = Task("regression", None, nn.functional.binary_cross_entropy_with_logits)
    with pytest.raises(ConfigError, match="which of them does train.loss") as err:
        check_task(task, TwoHeads()(torch.randn(2, 6)), torch.zeros(2, 3), 3, "m")
    assert err.value.hint.startswith("set signature.logits_output to its name or index")
    assert "binary_cross_entropy_with_logits(outputs[0], targets)" in err.value.hint
    picked = Task("regression", 1, nn.functional.binary_cross_entropy_with_logits)
    check_task(picked, TwoHeads()(torch.randn(2, 6)), torch.zeros(2, 3), 3, "m")


def own_bce(outputs: dict[str, torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
    """A loss of the user's, written for the whole output."""
    return nn.functional.binary_cross_entropy_with_logits(outputs["logits"], targets)


def scripted(fn: Any) -> Any:
    """``fn`` compiled by TorchScript (its module is then torch.jit), without the deprecation warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.jit.script(fn)


def test_a_torchscript_loss_of_the_users_keeps_the_whole_output() -> None:
    out = DictTagger()(torch.randn(2, 6))
    want = nn.functional.binary_cross_entropy_with_logits(out["logits"], torch.zeros(2, 3))
    assert torch.allclose(Task("regression", None, scripted(own_bce)).loss(out, torch.zeros(2, 3)), want)


@pytest.mark.parametrize(
    "loss",
    [
        functools.partial(nn.functional.binary_cross_entropy_with_logits, reduction="mean"),
        functools.partial(functools.partial(nn.functional.binary_cross_entropy_with_logits), reduction="mean"),
        nn.BCEWithLogitsLoss(),
    ],
)
def test_torch_losses_with_arguments_bound_or_as_modules_read_the_logits(loss: Any) -> None:
    out = DictTagger()(torch.randn(2, 6))
    want = nn.functional.binary_cross_entropy_with_logits(out["logits"], torch.zeros(2, 3))
    assert torch.allclose(Task("regression", None, loss).loss(out, torch.zeros(2, 3)), want)


def test_label_smoothing_bound_to_torchs_cross_entropy_reads_the_logits() -> None:
    smoothed = functools.partial(nn.functional.cross_entropy, label_smoothing=0.1)
    out, y = DictTagger()(torch.randn(2, 6)), torch.tensor([0, 2])
    assert torch.equal(Task("classification", None, smoothed).loss(out, y), smoothed(out["logits"], y))


class OwnLoss(nn.modules.loss._Loss):
    """A loss module of the user's, built on torch's base class: written for the whole output."""

    def forward(self, outputs: dict[str, torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.binary_cross_entropy_with_logits(outputs["logits"], targets)


def test_what_is_torchs_own_loss() -> None:
    assert from_torch(nn.functional.binary_cross_entropy_with_logits) and from_torch(nn.CrossEntropyLoss())
    assert from_torch(torch.binary_cross_entropy_with_logits)
    assert (
        not from_torch(scripted(own_bce)) and not from_torch(OwnLoss()) and not from_torch(functools.partial(own_bce))
    )


class ClickHead(nn.Module):
    """A binary head returning its logit and the sigmoid of it, as a CTR model does."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        logit = self.head(x)
        return {"logit": logit, "proba": torch.sigmoid(logit)}


def _clicks() -> DatasetSplits:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 6, generator=g)
    y = (x[:, :1] > 0).float()
    return DatasetSplits(x[:48], y[:48], x[48:], y[48:], num_classes=2)


@pytest.mark.parametrize("loss", [nn.functional.binary_cross_entropy_with_logits, nn.BCEWithLogitsLoss()])
def test_a_loss_on_logits_given_a_sigmoids_output_names_the_logit(loss: Any) -> None:
    """binary_cross_entropy_with_logits on a sigmoid's output trains on a second sigmoid and learns next to nothing:
    an error naming the logit output, at the first step; the logit itself trains."""
    data = _clicks()
    with pytest.raises(ConfigError) as exc:
        train(ClickHead(), data, CFG, task=Task("classification", "proba", loss))
    assert "the output it reads is a sigmoid's" in exc.value.message
    assert "signature.logits_output to output 'logit'" in (exc.value.hint or "")
    result = train(ClickHead(), data, CFG, task=Task("classification", "logit", loss))
    assert result.history[-1].loss < result.history[0].loss
    with torch.autocast("cpu", torch.bfloat16), pytest.raises(ConfigError) as exc:  # bf16 outputs: the same logit
        Task("classification", "proba", loss).loss(ClickHead()(data.train_x), data.train_y)
    assert "signature.logits_output to output 'logit'" in (exc.value.hint or "")
