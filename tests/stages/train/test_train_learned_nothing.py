"""A training in which every optimizer step was skipped learned nothing: an error, not weights that pass."""

from __future__ import annotations

import pytest

from kiln.core.errors import TrainingError
from kiln.stages.train.metrics import EpochMetrics, TrainResult
from kiln.stages.train.stage import check_learned


def history(*epochs: tuple[int, int, int]) -> TrainResult:
    """(steps, fp16-overflow skips, non-finite skips) per epoch."""
    result = TrainResult()
    result.history = [
        EpochMetrics(i + 1, float("nan"), 1.0, steps, 1e-3, skipped_steps=over, nonfinite_steps=bad)
        for i, (steps, over, bad) in enumerate(epochs)
    ]
    return result


@pytest.mark.parametrize("epochs", [[(3, 0, 3)], [(4, 4, 0)], [(2, 1, 1), (2, 0, 2)]])
def test_every_step_skipped_is_an_error(epochs: list[tuple[int, int, int]]) -> None:
    with pytest.raises(TrainingError, match="no training step was taken"):
        check_learned(history(*epochs))


@pytest.mark.parametrize("epochs", [[(3, 0, 2)], [(4, 3, 0)], []])
def test_one_step_taken_or_no_training_is_fine(epochs: list[tuple[int, int, int]]) -> None:
    check_learned(history(*epochs))
