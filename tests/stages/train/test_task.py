"""Float 0/1 labels, one per row, of a two-class dataset train a one-logit head with binary cross-entropy."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from kiln.core.data import DatasetSplits
from kiln.core.errors import ConfigError, ModelError
from kiln.core.user_errors import UserCodeError
from kiln.stages.train import task as task_module
from kiln.stages.train.config import TrainConfig
from kiln.stages.train.loop import train
from kiln.stages.train.task import Task, check_task, task_for


def _clicks(num_classes: int, shape: str = "[N, 1]", size: int = 128) -> DatasetSplits:
    """Separable 0/1 click labels (float) of the sign of the first feature."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(size, 3, generator=g)
    y = (x[:, 0] > 0).float()
    y = y[:, None] if shape == "[N, 1]" else y
    half = size // 2
    return DatasetSplits(x[:half], y[:half], x[half:], y[half:], num_classes=num_classes)


@pytest.mark.parametrize("shape", ["[N, 1]", "[N]"])
def test_zero_one_float_labels_of_two_classes_train_with_binary_cross_entropy(
    shape: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """They trained with mean squared error while validation read the output as a logit (decision above 0)."""
    monkeypatch.setattr(logging.getLogger("kiln"), "propagate", True)  # the CLI tests turn it off
    caplog.set_level(logging.INFO, logger="kiln.train")
    data = _clicks(2, shape)
    task = task_for(data, None, None)
    assert task.kind == "binary" and task.user_loss is None
    said = [r for r in caplog.records if r.name == "kiln.train" and "0/1 labels" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO
    assert "binary cross-entropy" in said[0].getMessage() and "train.loss" in said[0].getMessage()
    logit = torch.tensor([[2.0], [-1.0], [0.5], [-3.0]])
    y = data.train_y[:4]
    expected = nn.functional.binary_cross_entropy_with_logits(logit.view(-1), y.view(-1))
    assert torch.allclose(task.loss(logit, y), expected)
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    check_task(task, model(data.train_x[:2]), y[:2], 2, "m")
    config = TrainConfig(epochs=3, batch_size=16, device="cpu", plot=False, lr=0.1)
    result = train(model, data, config, task=task)
    assert result.history[-1].val_accuracy is not None and result.history[-1].val_accuracy > 0.8


@pytest.mark.parametrize("num_classes", [0, 3])
def test_zero_one_float_labels_without_two_classes_stay_regression_targets(num_classes: int) -> None:
    task = task_for(_clicks(num_classes), None, None)
    assert task.kind == "regression"
    assert torch.equal(task.loss(torch.ones(2, 1), torch.zeros(2, 1)), torch.tensor(1.0))


def test_float_targets_that_are_not_zero_one_stay_regression_targets() -> None:
    data = _clicks(2)
    data = DatasetSplits(data.train_x, data.train_y * 0.5, data.val_x, data.val_y * 0.5, num_classes=2)
    assert task_for(data, None, None).kind == "regression"


def test_train_loss_overrides_binary_cross_entropy() -> None:
    task = task_for(_clicks(2), "torch.nn.functional:mse_loss", None)
    assert task.kind == "regression" and task.user_loss is nn.functional.mse_loss


def test_a_two_column_head_beside_binary_labels_is_told_to_take_class_indices() -> None:
    with pytest.raises(ModelError, match="one logit per row") as err:
        check_task(Task("binary"), torch.zeros(2, 2), torch.tensor([[0.0], [1.0]]), 2, "m")
    assert "y.long().view(-1)" in err.value.hint


def test_a_sigmoid_output_is_refused_by_binary_cross_entropy_with_logits() -> None:
    probabilities = torch.sigmoid(torch.zeros(2, 1, requires_grad=True))
    with pytest.raises(ConfigError, match="sigmoid's output") as err:
        Task("binary").loss(probabilities, torch.tensor([[0.0], [1.0]]))
    assert "binary_cross_entropy" in err.value.hint


@pytest.mark.parametrize(("logits", "y"), [((2, 5, 8, 8), (2, 8, 8)), ((2, 6, 5), (2, 6))])
def test_float_class_indices_per_position_are_told_to_be_integers(logits: tuple, y: tuple) -> None:
    """Class maps [N, H, W] beside logits [N, C, H, W] have their class axis at 1, not last: they got the
    regression fix (match the output's shape) instead."""
    targets = torch.randint(0, 5, y).float()
    with pytest.raises(ModelError, match="mean squared error") as err:
        check_task(Task("regression"), torch.zeros(logits), targets, 5, "m")
    assert err.value.hint.startswith("give class labels as integers (y.long())")


def _upsampled_cross_entropy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Hugging Face's SegFormer loss: logits scaled up to the labels' size, then cross-entropy."""
    up = nn.functional.interpolate(outputs, size=targets.shape[-2:], mode="bilinear", align_corners=False)
    return nn.functional.cross_entropy(up, targets, ignore_index=-100)


def test_logits_at_a_fraction_beside_a_loss_that_scales_them_say_the_loss_cannot_stand_in() -> None:
    """The checks after export score the logits as the model returns them, whatever train.loss trained on: the fix
    said the same as without a loss, which the user had already tried to answer with one."""
    task = Task("classification", user_loss=_upsampled_cross_entropy)
    y = torch.randint(0, 5, (2, 16, 16))
    with pytest.raises(ModelError, match=r"class logits of shape \(2, 5, 4, 4\)") as err:
        check_task(task, torch.zeros(2, 5, 4, 4), y, 5, "m")
    assert "F.interpolate" in err.value.hint and "train.loss that scales them up cannot stand in" in err.value.hint
    with pytest.raises(ModelError) as plain:
        check_task(Task("classification"), torch.zeros(2, 5, 4, 4), y, 5, "m")
    assert "cannot stand in" not in plain.value.hint


def test_next_token_labels_one_shorter_than_the_logits_are_told_to_keep_the_input_length() -> None:
    """y = ids[:, 1:] beside [N, T, vocab] logits got the advice to change num_classes (already the vocabulary's),
    the logits output or a CTC loss, none of which applies."""
    ids = torch.randint(0, 7, (2, 6))
    with pytest.raises(ModelError, match=r"class logits of shape \(2, 6, 7\)") as err:
        check_task(Task("classification"), torch.zeros(2, 6, 7), ids[:, 1:], 7, "m")
    hint = err.value.hint
    assert "one position shorter" in hint and "pad(ids[:, 1:], (0, 1), value=-100)" in hint
    assert "num_classes" not in hint and "ctc_loss" not in hint


def test_positions_that_do_not_fit_leave_out_num_classes_where_the_head_already_has_them() -> None:
    with pytest.raises(ModelError) as err:
        check_task(Task("classification"), torch.zeros(2, 6, 7), torch.zeros(2, 3, dtype=torch.long), 7, "m")
    assert "num_classes" not in err.value.hint and "one row of class logits per labelled position" in err.value.hint
    with pytest.raises(ModelError) as err:
        check_task(Task("classification"), torch.zeros(2, 6, 7), torch.zeros(2, 3, dtype=torch.long), 9, "m")
    assert "set its num_classes to the dataset's" in err.value.hint


def _tuple_classifier(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A classifier's (logits, aux loss) pair of outputs: four class logits a row and a 0-D auxiliary loss."""
    return x[:, :4], x.sum()


def loss(outputs: tuple[torch.Tensor, torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
    """A user loss named ``loss`` (a common name) reading the tuple as forward returns it."""
    logits, aux = outputs
    return nn.functional.cross_entropy(logits, targets) + 0.01 * aux


def test_class_indices_of_shape_n_by_1_are_told_to_drop_the_column() -> None:
    """cross_entropy's '0D or 1D target tensor expected' on [N, 1] labels was answered with a wrapper named like the
    user's ``loss``, which called itself, and passed one tensor to a loss reading the tuple."""
    out, y = _tuple_classifier(torch.randn(2, 6)), torch.tensor([[0], [3]])
    with pytest.raises(UserCodeError, match="0D or 1D target tensor expected") as err:
        check_task(Task("classification", None, loss), out, y, 4, "m")
    hint = err.value.hint
    assert "class indices of shape [N, 1]" in hint and "return labels y[:, 0] from the data function" in hint, hint
    assert "pass targets.squeeze(1) to the loss in loss()" in hint, hint
    assert "def loss(" not in hint, hint


def test_a_torch_loss_on_n_by_1_class_indices_is_shown_a_wrapper_of_another_name() -> None:
    """train.loss naming torch's cross_entropy itself: the wrapper squeezes the targets, under a name of its own."""
    with pytest.raises(UserCodeError) as err:
        check_task(
            Task("classification", None, nn.functional.cross_entropy),
            torch.zeros(2, 4),
            torch.zeros(2, 1).long(),
            4,
            "m",
        )
    assert (
        "def wrapped_cross_entropy(outputs, targets): return cross_entropy(outputs, targets.squeeze(1))"
        in err.value.hint
    ), err.value.hint


def test_a_wrapper_is_never_named_like_the_function_it_calls() -> None:
    """A user loss named ``loss`` failing on a dict output: the wrapper shown must not shadow it and recurse."""

    def loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(outputs.float(), targets)

    out = {"logits": torch.zeros(2, 3), "aux": torch.zeros(())}
    with pytest.raises(UserCodeError, match="raised AttributeError") as err:
        check_task(Task("regression", None, loss), out, torch.zeros(2, 3), 0, "m")
    assert "def wrapped_loss(outputs, targets): return loss(outputs['logits'], targets)" in err.value.hint
    assert "def loss(" not in err.value.hint


def test_the_binary_loss_reads_the_output_s_graph_once_not_each_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sigmoid refusal walks the output's autograd graph on the first step that records one (a step under
    no_grad tells nothing), then no more: the model's graph is the same at every step."""
    walked: list[torch.Tensor] = []
    monkeypatch.setattr(task_module, "squashed_by", lambda t: walked.append(t))
    task, y = Task("binary"), torch.tensor([[0.0], [1.0]])
    with torch.no_grad():
        task.loss(torch.zeros(2, 1), y)
    for _ in range(3):
        task.loss(torch.zeros(2, 1, requires_grad=True) * 2, y)
    assert len(walked) == 1 and walked[0].grad_fn is not None


def test_a_sigmoid_output_is_refused_after_a_step_without_a_graph() -> None:
    task, y = Task("binary"), torch.tensor([[0.0], [1.0]])
    with torch.no_grad():
        task.loss(torch.sigmoid(torch.zeros(2, 1)), y)
    with pytest.raises(ConfigError, match="sigmoid's output"):
        task.loss(torch.sigmoid(torch.zeros(2, 1, requires_grad=True)), y)


def _nan_loss(outputs: dict[str, torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(outputs["cls"], targets[:, 0].long()) * float("nan")


def test_a_user_loss_nan_for_finite_outputs_is_refused_before_training() -> None:
    """It trained every step as non-finite and ended blaming the learning rate."""
    out = {"cls": torch.randn(2, 5), "age": torch.randn(2, 1)}
    y = torch.tensor([[1.0, 30.0, 0, 1, 0, 1], [3.0, 60.0, 1, 0, 0, 1]])
    with pytest.raises(ConfigError, match="train.loss .*_nan_loss' returns nan .* which are finite") as err:
        check_task(Task("regression", None, _nan_loss), out, y, 5, "m")
    assert "return a finite loss" in (err.value.hint or "")


def test_a_nan_loss_of_finite_outputs_over_ignored_labels_is_not_refused() -> None:
    """Two samples whose labels are all ignored give a mean over nothing (NaN): other batches have labels."""
    y = torch.full((2, 4), -100)
    check_task(Task("classification", None, nn.functional.cross_entropy), torch.randn(2, 3, 4), y, 3, "m")


def test_packed_float_targets_beside_class_logits_get_the_class_column_wrapper() -> None:
    """cross_entropy on float targets [N, 6] (class, age, attributes a row) got only 'name a function that does'."""
    out = {"cls": torch.randn(2, 5), "age": torch.randn(2, 1)}
    y = torch.tensor([[1.0, 30.0, 0, 1, 0, 1], [3.0, 60.0, 1, 0, 0, 1]])
    with pytest.raises(UserCodeError, match="multi-target not supported") as err:
        check_task(Task("regression", "cls", nn.functional.cross_entropy), out, y, 5, "m")
    want = "def wrapped_cross_entropy(outputs, targets): return cross_entropy(outputs['cls'], targets[:, 0].long())"
    assert want in (err.value.hint or ""), err.value.hint
