"""CTC labels ``[N, L]`` (padded with -100) beside class logits of their own length: a CRNN's time-major ``[T, N, C]``
or batch-first ``[N, T, C]`` log-probabilities."""

from __future__ import annotations

import logging

import pytest
import torch

from kiln.core.errors import ModelError
from kiln.stages.train.task import Task, check_task

CLASSES = 11


def _ctc_labels(rows: int = 2, length: int = 6) -> torch.Tensor:
    """Digit labels (1..10, 0 is the blank) of 2 to ``length`` per row, -100 past each row's end."""
    y = torch.full((rows, length), -100, dtype=torch.long)
    for i in range(rows):
        y[i, : 2 + i] = torch.arange(1, 3 + i)
    return y


def _ctc(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A CTC loss of the user's on time-major log-probabilities ``[T, N, C]``."""
    steps, rows, _ = outputs.shape
    lengths = (targets != -100).sum(1)
    frames = torch.full((rows,), steps, dtype=torch.long)
    return torch.nn.functional.ctc_loss(outputs, targets.clamp(min=0), frames, lengths, zero_infinity=True)


@pytest.mark.parametrize("length", [5, 6])
def test_time_major_logits_with_a_ctc_loss_are_not_told_to_scale_up(length: int) -> None:
    """Time-major logits [32, 2, 11]: their axis 0 is time, not the labels' batch, so labels [2, 6] (6 a multiple
    of 2) are not logits at a fraction of the labels' size; the user's loss reads them and nothing is refused."""
    logits = torch.randn(32, 2, CLASSES).log_softmax(2)
    check_task(Task("classification", None, _ctc), logits, _ctc_labels(2, length), CLASSES, "crnn")


def test_time_major_logits_without_a_loss_are_told_to_give_train_loss() -> None:
    logits = torch.randn(32, 2, CLASSES).log_softmax(2)
    with pytest.raises(ModelError, match=r"class logits of shape \(32, 2, 11\)") as err:
        check_task(Task("classification"), logits, _ctc_labels(2, 6), CLASSES, "crnn")
    assert "F.interpolate" not in err.value.hint and "train.loss" in err.value.hint


def test_ctc_labels_of_a_model_not_trained_here_are_warned_of_as_unscored(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Training skipped (train.enabled: false, no train.loss): labels of another length than the logits' positions
    are not scored, as the validate stage says; training them without a loss stays an error naming train.loss."""
    logits, y = torch.randn(2, 32, CLASSES).log_softmax(2), _ctc_labels(2, 5)
    monkeypatch.setattr(logging.getLogger("kiln"), "propagate", True)  # the CLI tests turn it off
    caplog.set_level(logging.WARNING, logger="kiln.train")
    task = Task("classification", trains=False)
    check_task(task, logits, y, CLASSES, "crnn_bf")
    said = [r.getMessage() for r in caplog.records if r.name == "kiln.train" and r.levelno == logging.WARNING]
    assert (
        len(said) == 1
        and "do not follow the positions" in said[0]
        and "labels [N, 5]" in said[0]
        and "[N, 32, 11]" in said[0]
    )
    assert task.correct(logits, y) is None and float(task.loss(logits, y)) == 0.0
    with pytest.raises(ModelError, match=r"class logits of shape \(2, 32, 11\)") as err:
        check_task(Task("classification"), logits, y, CLASSES, "crnn_bf")
    assert "train.loss" in err.value.hint and "ctc_loss" in err.value.hint
