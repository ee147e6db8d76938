"""Training any task: cross-entropy on the named logits output, MSE for float targets, or the user's loss."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch

from kiln.core.data import DatasetSplits
from kiln.core.errors import ConfigError, ModelError
from kiln.core.user_errors import UserCodeError
from kiln.models.datasets import synthetic_regression, synthetic_text
from kiln.models.registry import build_model
from kiln.stages.train.config import TrainConfig
from kiln.stages.train.loop import train
from kiln.stages.train.task import Task, check_task, scoring_task, task_for

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


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8])
def test_class_labels_of_any_integer_dtype_train_with_cross_entropy(dtype: torch.dtype) -> None:
    """int32 labels come from numpy and pandas; cross-entropy itself takes int64 only."""
    logits, y = torch.randn(4, 3), torch.tensor([0, 2, 1, 2])
    expected = torch.nn.functional.cross_entropy(logits, y)
    assert torch.equal(Task("classification").loss(logits, y.to(dtype)), expected)
    dense = torch.tensor([[0, 2, -100], [1, 1, 2]])
    per_position = Task("classification").loss(torch.randn(2, 3, 3), dense.to(torch.int32))
    assert per_position.isfinite()


def test_task_mismatches_are_clear_errors() -> None:
    out, y = torch.zeros(2, 3), torch.zeros(2, 1)
    with pytest.raises(ModelError, match="mean squared error needs the same shape"):
        check_task(Task("regression"), out, y, 0, "m")
    with pytest.raises(ModelError, match="mean squared error") as err:  # float labels of a 3-class task
        check_task(Task("regression"), out, torch.tensor([0.0, 2.0]), 3, "m")
    assert err.value.hint.startswith("give class labels as integers (y.long())")
    with pytest.raises(ConfigError, match="which is the class-logit output"):
        check_task(Task("classification"), (out, out), torch.zeros(2, dtype=torch.long), 3, "m")
    with pytest.raises(UserCodeError, match=r"loss function .* raised AttributeError: .* at .*test_train_task.py:\d+"):
        check_task(Task("custom", user_loss=lambda o, t: o.missing), out, y, 0, "m")


class Tagger(torch.nn.Module):
    """A tag per token: [N, S] ids -> [N, S, classes] logits."""

    def __init__(self, classes: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = torch.nn.Embedding(16, 8), torch.nn.Linear(8, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(ids)))


def tagged(size: int = 96, length: int = 6) -> DatasetSplits:
    """Tags = token id mod 3; each row's tail of random length is padding, tagged -100."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 16, (size, length), generator=g)
    pad = torch.arange(length)[None, :] >= torch.randint(1, length + 1, (size, 1), generator=g)
    y = torch.where(pad, -100, x % 3)
    n = size * 3 // 4
    return DatasetSplits(x[:n], y[:n], x[n:], y[n:], num_classes=3)


def test_token_labels_train_with_accumulation_equal_to_one_batch_and_score_labelled_tokens() -> None:
    """The loss is the mean over a batch's labelled tokens: two micro-batches (holding different numbers of labelled
    tokens) weighted by their share of them give the one-batch update exactly; accuracy counts labelled tokens."""
    data = tagged()
    task = task_for(data, None, None)
    one = TrainConfig(epochs=3, batch_size=24, device="cpu", plot=False, lr=0.05, optimizer="sgd", precision="fp32")
    a, b = Tagger(), Tagger()
    ra = train(a, data, one, task=task)
    rb = train(b, data, one.model_copy(update={"grad_accum_steps": 2}), task=task)
    assert max((pa - pb).abs().max().item() for pa, pb in zip(a.parameters(), b.parameters())) < 1e-6
    assert ra.history[-1].loss < ra.history[0].loss
    logits = a(data.val_x)
    keep = data.val_y != -100
    want = (logits.argmax(-1)[keep] == data.val_y[keep]).float().mean().item()
    assert ra.history[-1].val_accuracy == pytest.approx(want) and rb.history[-1].val_accuracy == pytest.approx(want)


def test_token_logits_of_the_wrong_shape_are_a_clear_error() -> None:
    y = torch.zeros(2, 6, dtype=torch.long)
    check_task(Task("classification"), torch.zeros(2, 6, 3), y, 3, "m")  # fits
    with pytest.raises(ModelError, match=r"class logits of shape \(2, 3\) for labels of shape \(2, 6\)"):
        check_task(Task("classification"), torch.zeros(2, 3), y, 3, "m")
    with pytest.raises(ModelError, match="has 2 classes, the dataset declares num_classes=3"):
        check_task(Task("classification"), torch.zeros(2, 6, 2), y, 3, "m")


def test_multi_hot_integer_labels_with_a_user_loss_count_no_accuracy() -> None:
    """The epoch's metrics crashed on [N, K] integer labels (a size mismatch in the argmax comparison)."""
    task = Task(
        "classification", None, lambda out, y: torch.nn.functional.binary_cross_entropy_with_logits(out, y.float())
    )
    logits = torch.randn(4, 6)
    assert task.correct(logits, torch.randint(0, 2, (4, 6))) is None
    assert task.correct(logits, torch.tensor([0, 5, 1, 2])) is not None


def _detached_ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out, y).detach()


class _DetachedOutput(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).detach()


def _three_classes() -> DatasetSplits:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    y = (x[:, 0] > 0).long()
    return DatasetSplits(x[:48], y[:48], x[48:], y[48:], num_classes=3)


def test_a_model_without_trainable_parameters_is_refused_before_training() -> None:
    model = torch.nn.Linear(8, 3).requires_grad_(False)
    with pytest.raises(ModelError, match=r"no parameter of the model requires grad \(all 2 are frozen\)") as err:
        train(model, _three_classes(), CFG, on_step=lambda step: pytest.fail("a step ran"))
    assert "requires_grad_(True)" in (err.value.hint or "")


def test_a_user_loss_without_gradient_is_named() -> None:
    task = Task("classification", None, _detached_ce)
    with pytest.raises(ConfigError, match=r"train.loss '.*:_detached_ce' returned a tensor that does not depend") as e:
        train(torch.nn.Linear(8, 3), _three_classes(), CFG, task=task, on_step=lambda s: pytest.fail("a step ran"))
    assert ".detach()" in (e.value.hint or "")


def test_a_model_whose_outputs_have_no_gradient_is_named() -> None:
    with pytest.raises(ModelError, match="outputs do not depend on its trainable parameters"):
        train(_DetachedOutput(), _three_classes(), CFG)


def test_logits_at_a_fraction_of_the_labels_size_are_told_to_scale_up_even_with_a_user_loss() -> None:
    """A SegFormer's logits are at a quarter of the image: with its own loss (which scales them up) training ran
    and precision stopped on the labels' shape; now both forms stop before training, saying how to fit them."""
    y, logits = torch.zeros(2, 32, 32, dtype=torch.long), torch.zeros(2, 3, 8, 8)
    for task in (Task("classification"), Task("classification", None, lambda out, y: out.mean())):
        with pytest.raises(ModelError, match=r"class logits of shape \(2, 3, 8, 8\)") as err:
            check_task(task, logits, y, 3, "m")
        assert "F.interpolate(logits" in err.value.hint and "labels at the logits' size (8, 8)" in err.value.hint


@pytest.mark.parametrize(("spatial", "mode"), [((8, 8), "bilinear"), ((4, 8, 8), "trilinear")])
def test_the_scale_up_fix_names_the_interpolation_of_the_logits_rank(spatial: tuple[int, ...], mode: str) -> None:
    """A volume's logits (a 3-D UNet's at half the labels' size) scale up trilinearly: bilinear fails on 5-D."""
    y = torch.zeros(2, *(2 * s for s in spatial), dtype=torch.long)
    with pytest.raises(ModelError) as err:
        check_task(Task("classification"), torch.zeros(2, 3, *spatial), y, 3, "m")
    assert f"mode='{mode}'" in err.value.hint, err.value.hint


def test_labels_with_a_channel_axis_of_one_are_told_to_squeeze_it() -> None:
    """Medical-imaging masks come as [N, 1, D, H, W] beside logits [N, C, D, H, W]: the fix is y.squeeze(1)."""
    y, logits = torch.zeros(2, 1, 4, 8, 8, dtype=torch.long), torch.zeros(2, 3, 4, 8, 8)
    with pytest.raises(ModelError) as err:
        check_task(Task("classification"), logits, y, 3, "m")
    assert "y.squeeze(1)" in err.value.hint and "(2, 4, 8, 8)" in err.value.hint, err.value.hint
    check_task(Task("classification", None, lambda out, y: out.mean()), torch.zeros(2, 6), y[:, 0, :6], 3, "m")


@pytest.mark.parametrize(
    ("out", "read"),
    [
        (torch.zeros(2, 1), "outputs"),
        ((torch.zeros(2, 1),), "outputs[0]"),
        ({"value": torch.zeros(2, 1)}, "outputs['value']"),
    ],
)
def test_a_loss_of_one_number_per_sample_is_told_how_to_read_the_outputs(out, read) -> None:
    """The fix said outputs[0] whatever forward returned: for a tensor output that is the first sample's row,
    and a loss written so trained a useless model that passed."""
    per_row = Task("regression", None, lambda o, y: torch.zeros(len(y)))
    with pytest.raises(ConfigError, match=r"returned a tensor of shape \[2\]; it must return one scalar") as err:
        check_task(per_row, out, torch.zeros(2, 1), 0, "m")
    assert f"mse_loss({read}, targets)" in err.value.hint


@pytest.mark.parametrize(
    ("loss", "fix"),
    [
        (lambda o, y: (o.mean(), {"hm_loss": o.mean().detach()}), "return only the loss tensor"),
        (lambda o, y: [o.mean(), o.sum()], "return only the loss tensor"),
        (lambda o, y: o.mean().item(), "without .item()/float()"),
        (lambda o, y: 0, "without .item()/float()"),
    ],
)
def test_a_loss_returning_a_tuple_or_a_python_number_is_told_what_to_return(loss, fix) -> None:
    """Both were told to reduce the loss to one number, e.g. with an MSE: a tuple (loss, stats) as CenterNet's
    trainer returns needs its loss alone, and a number from .item() is one already."""
    with pytest.raises(ConfigError, match="it must return one scalar tensor") as err:
        check_task(Task("regression", None, loss), torch.zeros(2, 1), torch.zeros(2, 1), 0, "m")
    assert fix in err.value.hint and "mse_loss" not in err.value.hint


@pytest.mark.parametrize(
    ("loss", "got"),
    [
        (lambda o, y: (o.mean(), {"loss": 0.0}), "a tuple"),
        (lambda o, y: float(o.detach().mean()), "a float"),
        (lambda o, y: (o - 1).pow(2).mean(dim=1), r"a tensor of shape \[32\]"),
    ],
)
def test_a_loss_that_is_not_one_scalar_is_refused_without_labels_too(loss, got) -> None:
    """A label-free loss (called as loss(outputs, None)) skips check_task's label checks: its tuple, float or vector
    reached backward() and the loss statistics as a traceback. Task.loss refuses it wherever it is called."""
    task = Task("regression", None, loss, labels=False)
    with pytest.raises(ConfigError, match=f"returned {got}; it must return one scalar tensor"):
        task.loss(torch.zeros(32, 3, requires_grad=True), torch.zeros(32))


def test_a_loss_of_shape_one_is_squeezed_to_a_scalar() -> None:
    task = Task("regression", None, lambda o, y: o.mean().reshape(1))
    value = task.loss(torch.ones(4, 3, requires_grad=True), torch.zeros(4))
    assert value.shape == () and value.requires_grad


def _one_hot(n: int, classes: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.arange(n) % classes, classes).float()


@pytest.mark.parametrize(
    ("train_y", "num_classes", "loss", "warned"),
    [
        (_one_hot(8, 4), 4, None, "one-hot"),
        (_one_hot(8, 4), 0, None, None),  # no classes declared: regression targets that happen to be 0/1
        (_one_hot(8, 4) * 0.5, 4, None, None),  # soft targets
        (_one_hot(8, 4) + _one_hot(8, 4).roll(1, 1), 4, None, "multi-hot"),  # two 1s a row: multi-label
        (_one_hot(8, 4).clamp(min=1), 4, None, "multi-hot"),
        (_one_hot(8, 4), 4, "torch.nn.functional:cross_entropy", None),  # the user's loss reads them
        (_one_hot(8, 4).clamp(min=1), 4, "torch.nn.functional:binary_cross_entropy_with_logits", None),
        (torch.arange(8) % 4, 4, None, None),  # class indices
    ],
)
def test_zero_one_float_labels_with_classes_are_warned_of(
    train_y, num_classes, loss, warned, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """They trained silently as MSE regression with no accuracy, the user's num_classes notwithstanding: one-hot rows
    are told to become class indices, multi-hot rows (multi-label targets) to take a BCE loss and multilabel_f1."""
    said = _warnings(caplog, monkeypatch, lambda: task_for(_rows(train_y, num_classes), loss, None))
    said = [m for m in said if "rows (0/1" in m]
    assert len(said) == int(warned is not None), said
    if warned:
        assert f"train_y is float [8, 4] of {warned} rows" in said[0] and "num_classes=4" in said[0]
    if warned == "one-hot":
        assert "y.argmax(1)" in said[0] and "binary_cross_entropy" not in said[0]
    if warned == "multi-hot":
        assert "train.loss: torch.nn.functional:binary_cross_entropy_with_logits" in said[0]
        assert "validate.metric: multilabel_f1" in said[0] and "y.argmax(1)" not in said[0]


def _per_pixel_one_hot(classes: int = 4) -> torch.Tensor:
    """Float one-hot class maps [8, classes, 6, 6]: F.one_hot of [8, 6, 6] labels with the classes moved to axis 1."""
    y = torch.arange(8 * 36).reshape(8, 6, 6) % classes
    return torch.nn.functional.one_hot(y, classes).permute(0, 3, 1, 2).float()


def _per_token_one_hot(classes: int = 4) -> torch.Tensor:
    """Float one-hot tags [8, 6, classes], the classes on the last axis as a tagger's logits hold them."""
    return torch.nn.functional.one_hot(torch.arange(48).reshape(8, 6) % classes, classes).float()


@pytest.mark.parametrize(
    ("train_y", "num_classes", "warned", "fix"),
    [
        (_per_pixel_one_hot(), 4, "one-hot", "y.argmax(1) gives class indices [8, 6, 6]"),
        (_per_token_one_hot(), 4, "one-hot", "y.argmax(-1) gives class indices [8, 6]"),
        ((_per_pixel_one_hot() + _per_pixel_one_hot().roll(1, 1)).clamp(max=1), 4, "multi-hot", None),
        (_per_pixel_one_hot(), 0, None, None),  # no classes declared: 0/1 regression targets
        (torch.randn(8, 4, 6, 6), 0, None, None),  # a denoiser's noise
        (torch.randn(8, 4, 6, 6), 4, None, None),  # a class-conditional denoiser's noise
        (_per_pixel_one_hot() * 0.5, 4, None, None),  # soft targets
        (_per_pixel_one_hot(4).permute(0, 2, 3, 1), 4, None, None),  # classes last of four axes: not the class axis
        (_per_token_one_hot().transpose(1, 2), 4, None, None),  # classes on axis 1 of three: not the class axis
    ],
)
def test_zero_one_float_labels_per_position_are_warned_of(
    train_y, num_classes, warned, fix, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One-hot class maps [N, C, H, W] (and one-hot tags [N, seq, C]) beside num_classes trained silently as MSE
    regression and passed every gate: their classes lie on the axis class logits hold them on, and they are warned
    of like one-hot rows, with the argmax over that axis as the fix. Float noise of that shape is no label."""
    said = _warnings(caplog, monkeypatch, lambda: task_for(_rows(train_y, num_classes), None, None))
    said = [m for m in said if "(0/1" in m]
    assert len(said) == int(warned is not None), said
    if warned is None:
        return
    assert said[0].startswith(f"train_y is float {list(train_y.shape)} of {warned} labels per position (0/1 on ")
    assert f"num_classes={num_classes}" in said[0]
    if fix:
        assert fix in said[0] and "binary_cross_entropy" not in said[0]
    else:
        assert "train.loss: torch.nn.functional:binary_cross_entropy_with_logits" in said[0]
        assert "validate.metric: multilabel_f1" in said[0] and "argmax" not in said[0]


def test_one_hot_class_maps_take_the_warned_fix_and_train_with_cross_entropy() -> None:
    """The fix the warning gives, y.argmax(1), is labels per pixel that train with cross-entropy and accuracy."""
    y = _per_pixel_one_hot()
    data = _rows(y.argmax(1), 4)
    data.train_x, data.val_x = torch.randn(8, 3, 6, 6), torch.randn(4, 3, 6, 6)
    task = task_for(data, None, None)
    assert task.kind == "classification"
    model = torch.nn.Conv2d(3, 4, 1)
    check_task(task, model(data.train_x[:2]), data.train_y[:2], 4, "m")
    result = train(model, data, TrainConfig(epochs=1, batch_size=4, device="cpu", plot=False), task=task)
    assert result.history[-1].val_accuracy is not None


def _rows(train_y: torch.Tensor, num_classes: int) -> DatasetSplits:
    return DatasetSplits(torch.zeros(8, 3), train_y, torch.zeros(4, 3), train_y[:4], num_classes=num_classes)


def _warnings(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, run: Callable[[], Any]) -> list[str]:
    """The kiln.train warnings that ``run`` logs."""
    monkeypatch.setattr(logging.getLogger("kiln"), "propagate", True)  # the CLI tests turn it off
    caplog.set_level(logging.WARNING, logger="kiln.train")
    run()
    return [r.getMessage() for r in caplog.records if r.name == "kiln.train" and r.levelno == logging.WARNING]


def _tokens(size: int = 8, length: int = 6) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Token ids (0 on padding) with their attention mask, and the next-token labels (-100 past each row's end)."""
    g = torch.Generator().manual_seed(0)
    mask = (torch.arange(length)[None, :] < torch.randint(3, length + 1, (size, 1), generator=g)).long()
    ids = (torch.randint(1, 12, (size, 1), generator=g) + torch.arange(length)) * mask
    y = torch.full_like(ids, -100)
    y[:, :-1] = ids[:, 1:]
    y[torch.roll(mask, -1, 1) == 0] = -100
    return {"input_ids": ids, "attention_mask": mask}, y


def _lm_data(y: torch.Tensor, x: dict[str, torch.Tensor]) -> DatasetSplits:
    return DatasetSplits(x, y, x, y, num_classes=32)


@pytest.mark.parametrize("loss", [None, "torch.nn.functional:cross_entropy"])
def test_labels_equal_to_the_input_ids_are_warned_of_with_the_shift(
    loss, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hugging Face's causal-LM labels = input_ids (its model shifts them) trained a copy model that scored 1.0."""
    x, shifted = _tokens()
    copy = x["input_ids"].masked_fill(x["attention_mask"] == 0, -100)
    said = _warnings(caplog, monkeypatch, lambda: task_for(_lm_data(copy, x), loss, None))
    copies = [m for m in said if "equals input" in m]
    assert len(copies) == 1, said
    assert copies[0].startswith("train_y equals input 'input_ids' at every labelled position")
    assert "y[:, :-1] = input_ids[:, 1:] and y[:, -1] = -100" in copies[0]
    caplog.clear()
    assert not _warnings(caplog, monkeypatch, lambda: task_for(_lm_data(shifted, x), loss, None))


def test_labels_on_padding_are_warned_of_once_with_their_count(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Token labels without -100 where the attention mask is 0 counted padding in accuracy and top-1 agreement."""
    x, y = _tokens()
    tags = x["input_ids"] % 3  # a tag on every position, padding too
    padding = int((x["attention_mask"] == 0).sum())
    said = _warnings(caplog, monkeypatch, lambda: scoring_task(_lm_data(tags, x), None, None))
    assert len(said) == 1, said
    assert said[0].startswith(f"labels are set at {padding} positions of train_y and {padding} positions of val_y")
    assert "where input 'attention_mask' is 0" in said[0] and "y[attention_mask == 0] = -100" in said[0]
    caplog.clear()
    kept = tags.masked_fill(x["attention_mask"] == 0, -100)
    assert not _warnings(caplog, monkeypatch, lambda: scoring_task(_lm_data(kept, x), None, None))


def test_one_label_per_row_for_logits_per_position_names_the_mismatch() -> None:
    """It said the dataset's class count differed from the model's, and the fix (num_classes) could not work."""
    x, y = torch.randint(0, 16, (2, 6)), torch.tensor([0, 1])
    with pytest.raises(
        ModelError,
        match=r"class logits of shape \(2, 6, 2\), one row of class scores per position, but "
        r"the labels have shape \(2,\), one per row",
    ) as err:
        check_task(Task("classification"), Tagger(classes=2)(x), y, 2, "m")
    assert err.value.hint.startswith("give labels per position [N, 6] (-100 where a position has no label)")
    assert "pool to one row of class logits per sample" in err.value.hint and "num_classes" not in err.value.hint
    segmentation = torch.zeros(2, 3, 4, 5)  # [N, C, H, W]
    with pytest.raises(ModelError, match="one per row") as err:
        check_task(Task("classification"), segmentation, y, 3, "m")
    assert "[N, 4, 5]" in err.value.hint


def test_what_the_data_checks_warn_of_is_in_the_report_where_accuracy_is_read() -> None:
    """The console's warning alone left report.md stating an accuracy that counted padding, without a caveat."""
    from kiln.stages.train.declaration import TrainSummary
    from kiln.stages.train.report import report_section
    from kiln.stages.train.stage import said_warnings

    with said_warnings(logging.getLogger("kiln.train")) as said:
        x, _ = _tokens()
        scoring_task(_lm_data(x["input_ids"] % 3, x), None, None)
    assert len(said) == 1 and "attention_mask" in said[0]
    for status in ("ran", "skipped"):
        summary = TrainSummary(status=status, precision="fp32", device="cpu", steps=3, val_accuracy=0.9)
        summary.data_warnings, summary.source = said, "random init"
        lines = report_section(summary)
        assert f"- **Data:** {said[0]}" in lines, (status, lines)


def _clicks(size: int = 64) -> DatasetSplits:
    """Binary click labels: float 0/1, one per row."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(size, 4, generator=g)
    y = (x[:, 0] > 0).float()
    return DatasetSplits(x[:48], y[:48], x[48:], y[48:])


def _sigmoid_head() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 1), torch.nn.Flatten(0), torch.nn.Sigmoid())


def _wrapped_bce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.binary_cross_entropy(out, y)


@pytest.mark.parametrize("loss", ["torch.nn.functional:binary_cross_entropy", f"{__name__}:_wrapped_bce"])
def test_a_loss_failing_under_autocast_is_named_with_the_logits_form_as_fix(loss: str) -> None:
    """torch's binary_cross_entropy named as train.loss gave a traceback under bf16 autocast (no frame of the
    user's to name); wrapped in the user's own function it got the error/fix pair. Both now name the function."""
    data, cfg = _clicks(), CFG.model_copy(update={"precision": "bf16"})
    with pytest.raises(UserCodeError, match=rf"loss function '{loss}' raised RuntimeError: .*under bf16 autocast") as e:
        train(_sigmoid_head(), data, cfg, task=task_for(data, loss, None))
    assert "train.loss: torch.nn.functional:binary_cross_entropy_with_logits" in e.value.hint
    assert "train without autocast (train.precision: fp32)" in e.value.hint
    fp32 = train(_sigmoid_head(), data, CFG.model_copy(update={"precision": "fp32"}), task=task_for(data, loss, None))
    assert fp32.history[-1].loss < fp32.history[0].loss


def test_a_library_loss_failing_on_two_samples_is_named() -> None:
    """It said 'train.loss failed on the model's outputs' without naming the function."""
    bce = Task("regression", None, torch.nn.functional.binary_cross_entropy_with_logits)
    name = "'torch.nn.functional:binary_cross_entropy_with_logits'"
    with pytest.raises(UserCodeError, match=f"loss function {name} raised ValueError: .* for two samples") as e:
        check_task(bce, torch.zeros(2, 3), torch.zeros(2, 1), 0, "m")
    assert e.value.hint.startswith("train.loss takes (outputs, targets)")


def _own_bce(outputs: dict[str, torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.binary_cross_entropy_with_logits(outputs["score"], targets)


@pytest.mark.parametrize(
    ("loss", "out", "y", "fix"),
    [
        (
            torch.nn.functional.binary_cross_entropy_with_logits,
            torch.zeros(2, 1),
            torch.tensor([0.0, 1.0]),
            "takes targets shaped like the output it reads, [N, 1]: return labels y.view(-1, 1) from the data "
            "function, or wrap it in a function of your own: def wrapped_binary_cross_entropy_with_logits(outputs, "
            "targets): return binary_cross_entropy_with_logits(outputs, targets.view_as(outputs))",
        ),
        (
            torch.nn.functional.binary_cross_entropy_with_logits,
            torch.zeros(2),
            torch.tensor([0, 1]),
            "takes targets as floats: return labels y.float() from the data function, or wrap it in a function of "
            "your own: def wrapped_binary_cross_entropy_with_logits(outputs, targets): return "
            "binary_cross_entropy_with_logits(outputs, targets.float())",
        ),
        (
            torch.nn.functional.binary_cross_entropy_with_logits,
            torch.zeros(2, 1),
            torch.tensor([0, 1]),
            "takes targets shaped like the output it reads, [N, 1] and as floats: return labels "
            "y.float().view(-1, 1) from the data function",
        ),
        (
            _own_bce,
            {"score": torch.zeros(2, 1), "user_vec": torch.zeros(2, 4)},
            torch.tensor([0.0, 1.0]),
            "pass targets.view_as(outputs['score']) to the loss in _own_bce()",
        ),
    ],
    ids=["[N] beside [N, 1]", "integer beside [N]", "both", "own function"],
)
def test_a_loss_failing_on_the_targets_shape_or_dtype_is_told_how_to_shape_them(
    loss: Any, out: Any, y: torch.Tensor, fix: str
) -> None:
    """The fix repeated the failing call as the wrapper to write; it now says how to give the targets."""
    with pytest.raises(UserCodeError) as err:
        check_task(Task("classification", None, loss), out, y, 2, "m")
    assert fix in err.value.hint, err.value.hint
    assert "return binary_cross_entropy_with_logits(outputs, targets)" not in err.value.hint


@pytest.mark.parametrize(
    ("train_y", "loss", "warned"),
    [
        (torch.tensor([0.0, 1.0] * 4), None, True),
        (torch.tensor([[0.0], [1.0]] * 4), None, True),
        (torch.tensor([0.0, 1.0] * 4), "torch.nn.functional:binary_cross_entropy_with_logits", False),
        (torch.tensor([0.0, 0.5] * 4), None, False),  # regression targets
        (torch.tensor([0.0, 1.0] * 4).view(4, 2), None, False),  # two targets a row
    ],
)
def test_zero_one_float_labels_one_per_row_are_warned_of_as_binary(
    train_y, loss, warned, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Click labels beside a one-logit head trained silently with mean squared error on the logit."""
    data = DatasetSplits(torch.zeros(len(train_y), 3), train_y, torch.zeros(4, 3), train_y[:4])
    said = [m for m in _warnings(caplog, monkeypatch, lambda: task_for(data, loss, None)) if "one per row" in m]
    assert len(said) == int(warned), said
    if warned:
        assert said[0].startswith(f"train_y is float {list(train_y.shape)} of 0/1 labels, one per row")
        assert "mean squared error" in said[0] and "validate.metric: multilabel_f1" in said[0]
        assert "train.loss: torch.nn.functional:binary_cross_entropy_with_logits" in said[0]
        assert "num_classes=2 in DatasetSplits (validation then holds its decision)" in said[0]
        # labels [N] beside an [N, 1] logit: the loss and the metric both take them shaped like it
        assert ("y.view(-1, 1)" in said[0]) == (train_y.ndim == 1)


def test_val_labels_that_happen_to_be_zero_or_one_are_not_binary(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Continuous training targets decide the task: a few held-out rows at 0 and 1 are no classifier's."""
    data = DatasetSplits(torch.zeros(8, 3), torch.rand(8), torch.zeros(4, 3), torch.tensor([0.0, 1.0, 1.0, 0.0]))
    said = [m for m in _warnings(caplog, monkeypatch, lambda: task_for(data, None, None)) if "one per row" in m]
    assert not said


@pytest.mark.parametrize(("logits", "shaped"), [(torch.zeros(2, 1), "[N, 1]"), (torch.zeros(2), "[N] (y.float())")])
def test_integer_labels_beside_one_logit_are_told_of_binary_cross_entropy(logits, shaped) -> None:
    """It said to set the model's num_classes: a click-through model's one logit wants float labels and BCE."""
    with pytest.raises(ModelError, match="but the dataset has 2 classes") as err:
        check_task(Task("classification"), logits, torch.tensor([0, 1]), 2, "m")
    assert f"float 0/1 labels shaped like its output {shaped}" in err.value.hint
    assert "binary_cross_entropy_with_logits" in err.value.hint and "two logits [N, 2]" in err.value.hint
    assert "num_classes=2 kept in DatasetSplits" in err.value.hint  # float labels without it are a regression's
    with pytest.raises(ModelError) as err:  # too few of several logits: the model's class count
        check_task(Task("classification"), torch.zeros(2, 2), torch.tensor([0, 2]), 3, "m")
    assert err.value.hint.startswith("give the model as many class logits as the dataset has classes")


@pytest.mark.parametrize("trains", [True, False])
def test_one_output_row_for_several_is_worded_for_whether_the_model_trains(trains: bool) -> None:
    """Without training (train.enabled: false) the error spoke of the loss and told to set train.batch_size."""
    task = Task("classification", None, trains=trains)
    with pytest.raises(ModelError, match="1 row of output") as err:
        check_task(task, torch.zeros(1, 5, 4), torch.zeros(2, dtype=torch.long), 4, "m")
    assert ("the loss pairs" in str(err.value)) is trains and ("validation pairs" in str(err.value)) is not trains
    assert ("train.batch_size" in err.value.hint) is trains and "signature.batch_sizes: [1]" in err.value.hint
