"""0/1 targets shaped like the class logits, and class logits per position, checked before training: integer
multi-hot rows, a num_classes other than the label width, too few classes per position; and no training warning
where nothing trains."""

from __future__ import annotations

import logging

import pytest
import torch

from kiln.core.data import DatasetSplits
from kiln.core.errors import ConfigError, ModelError
from kiln.stages.train.task import Task, check_task, scoring_task

MULTI_HOT = torch.tensor([[1, 0, 1, 0], [0, 1, 1, 1]])


def _bce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.binary_cross_entropy_with_logits(out, y.float())


@pytest.mark.parametrize("loss", [None, _bce])
def test_integer_multi_hot_labels_are_told_to_be_floats_before_training(loss: object) -> None:
    """Integer multi-hot rows as wide as the logits trained (with a loss casting them) and failed only at the
    precision stage, whose fix was wrong; without a loss the fix spoke of several targets per sample."""
    with pytest.raises(ConfigError, match=r"integer 0/1 \[2, 4\]") as info:
        check_task(Task("classification", None, loss), torch.randn(2, 4), MULTI_HOT, 4, "m")  # type: ignore[arg-type]
    assert "multi-label targets: cast them to float" in (info.value.hint or "")
    assert "multilabel_f1" in (info.value.hint or "")


def test_float_multi_hot_targets_of_another_width_than_num_classes_are_refused() -> None:
    """num_classes 5 beside 4 labels a row switched validation's decision gate off with no word."""
    with pytest.raises(ConfigError, match="4 labels per row, the dataset declares num_classes=5") as info:
        check_task(Task("regression", None, _bce), torch.randn(2, 4), MULTI_HOT.float(), 5, "m")
    assert "num_classes=4" in (info.value.hint or "")
    check_task(Task("regression", None, _bce), torch.randn(2, 4), MULTI_HOT.float(), 4, "m")  # the same: fits


def test_too_few_classes_per_position_is_said_as_a_class_count() -> None:
    """Node labels [B, N] beside node logits of 2 classes where the data declares 3 read as a shape mismatch."""
    y = torch.tensor([[0, 2, 1, -100], [1, 0, -100, -100]])
    with pytest.raises(ModelError, match="has 2 classes, the dataset declares num_classes=3") as info:
        check_task(Task("classification", "node_logits"), {"node_logits": torch.zeros(2, 4, 2)}, y, 3, "m")
    assert "output 'node_logits'" in str(info.value)
    assert "shaped like the labels plus a class axis" not in str(info.value)


def test_a_model_not_trained_here_gets_no_warning_of_its_float_labels(caplog: pytest.LogCaptureFixture) -> None:
    """train.enabled: false with multi-hot float labels warned that they train with mean squared error."""
    y = (torch.rand(16, 4, generator=torch.Generator().manual_seed(0)) < 0.4).float()
    data = DatasetSplits(torch.randn(16, 8), y, torch.randn(16, 8), y, num_classes=4)
    with caplog.at_level(logging.WARNING, logger="kiln.train"):
        task = scoring_task(data, None, None)
    assert task is not None and not task.trains
    assert not [r for r in caplog.records if "regression targets" in r.getMessage()]
