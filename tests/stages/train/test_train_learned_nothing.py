"""A training in which every optimizer step was skipped learned nothing: an error, not weights that pass. One whose
loss fell while held-out accuracy stayed where it started, and whose held-out loss did not fall below chance level,
is warned of."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from kiln.core.errors import TrainingError
from kiln.stages.train.metrics import EpochMetrics, TrainResult
from kiln.stages.train.stage import chance_loss, check_learned, warn_learned_nothing_held_out
from kiln.stages.train.task import Task


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
    with pytest.raises(TrainingError, match="no training step was taken") as caught:
        check_learned(history(*epochs))
    # fp16 overflows alone are the loss scale's to fix; a non-finite loss or gradients are the data's or the lr's
    only_overflows = all(bad == 0 for _, _, bad in epochs)
    assert ("train.amp.loss_scale" in caught.value.hint) == only_overflows, caught.value.hint


@pytest.mark.parametrize("epochs", [[(3, 0, 2)], [(4, 3, 0)], []])
def test_one_step_taken_or_no_training_is_fine(epochs: list[tuple[int, int, int]]) -> None:
    check_learned(history(*epochs))


def _curve(losses: list[float], accuracies: list[float]) -> list[EpochMetrics]:
    return [
        EpochMetrics(i + 1, loss, 1.0, 4, 1e-3, val_loss=1.0, val_accuracy=acc)
        for i, (loss, acc) in enumerate(zip(losses, accuracies))
    ]


def test_a_falling_loss_with_accuracy_stuck_at_its_first_value_is_warned_of(caplog: pytest.LogCaptureFixture) -> None:
    """Training loss 2.13 -> 0.068 with held-out accuracy 0.086 throughout (10 classes), as from a BatchNorm of a
    small momentum: the model answers at chance in eval mode, and validation would pass engines that agree with
    it."""
    with caplog.at_level(logging.WARNING, logger="kiln.train"):
        warn_learned_nothing_held_out(_curve([2.13, 0.9, 0.2, 0.068], [0.0859, 0.0859, 0.0859, 0.0859]))
    said = " ".join(caplog.messages)
    assert "training loss fell from 2.13 (epoch 1) to 0.068 (epoch 4)" in said and "stayed at 0.086" in said
    assert "model.eval()" in said and "momentum" in said


@pytest.mark.parametrize(
    ("losses", "accuracies"),
    [
        ([2.1, 0.9, 0.2], [0.3, 0.6, 0.9]),  # learning that shows on the held-out rows
        ([2.1, 1.9, 1.8], [0.3, 0.3, 0.3]),  # a loss that barely fell: nothing learned, nothing to say
        ([2.1, 0.1], [0.3, 0.3]),  # too few epochs to tell
        ([1.14, 0.8, 0.6, 0.533], [0.99916, 0.99997, 1.0, 1.0]),  # right from the first epoch: no room to rise
    ],
)
def test_learning_that_shows_held_out_is_not_warned_of(
    losses: list[float], accuracies: list[float], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kiln.train"):
        warn_learned_nothing_held_out(_curve(losses, accuracies))
    assert not caplog.messages


def _tagger_curve(val_losses: list[float | None]) -> list[EpochMetrics]:
    """A named-entity tagger's epochs: most tokens are 'O', so held-out accuracy starts high and moves little."""
    losses, accuracies = [1.9, 0.9, 0.6, 0.45, 0.38, 0.35], [0.817, 0.818, 0.82, 0.821, 0.824, 0.825]
    return [
        EpochMetrics(i + 1, loss, 1.0, 4, 1e-3, val_loss=val, val_accuracy=acc)
        for i, (loss, val, acc) in enumerate(zip(losses, val_losses, accuracies))
    ]


def test_a_held_out_loss_falling_with_the_training_loss_is_not_warned_of(caplog: pytest.LogCaptureFixture) -> None:
    """A held-out loss falling 1.43 -> 0.48, below chance level (ln 9 = 2.2 for 9 classes), shows learning where
    held-out accuracy moves little (0.817 -> 0.825: most tokens are one class)."""
    with caplog.at_level(logging.WARNING, logger="kiln.train"):
        warn_learned_nothing_held_out(_tagger_curve([1.43, 0.9, 0.7, 0.6, 0.52, 0.48]), chance=math.log(9))
    assert not caplog.messages


@pytest.mark.parametrize(
    "val_losses",
    [
        [1.43, 1.42, 1.44, 1.43, 1.41, 1.43],  # flat
        [1.43, 1.6, 1.9, 2.2, 2.5, 2.9],  # rising: labels that do not belong to their inputs
        [None] * 6,  # not measured
    ],
)
def test_a_held_out_loss_that_does_not_fall_keeps_the_warning(
    val_losses: list[float | None], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kiln.train"):
        warn_learned_nothing_held_out(_tagger_curve(val_losses), chance=math.log(9))
    assert any("does not show on the held-out rows" in m for m in caplog.messages)


def _eval_mode_at_chance(val_losses: list[float]) -> list[EpochMetrics]:
    """Epochs of a 10-class model that trains well and answers at chance in eval mode (BatchNorm running statistics
    far from its batches'): held-out accuracy flat, held-out loss far above chance (its logits are large)."""
    losses = [2.18, 1.88, 1.53, 1.18, 0.91, 0.72]
    return [
        EpochMetrics(i + 1, loss, 1.0, 50, 1e-3, val_loss=val, val_accuracy=0.161)
        for i, (loss, val) in enumerate(zip(losses, val_losses))
    ]


@pytest.mark.parametrize("chance", [math.log(10), None])
def test_a_held_out_loss_falling_but_above_chance_keeps_the_warning(
    chance: float | None, caplog: pytest.LogCaptureFixture
) -> None:
    """A held-out loss that halves (61 -> 30) yet stays far above chance level (ln 10 = 2.3) is no sign of
    learning; nor is any falling held-out loss where chance level is unknown (a train.loss of the user's)."""
    with caplog.at_level(logging.WARNING, logger="kiln.train"):
        warn_learned_nothing_held_out(_eval_mode_at_chance([61.3, 53.8, 47.3, 41.3, 35.7, 29.6]), chance=chance)
    assert any("stayed at 0.161" in m for m in caplog.messages)


def test_a_held_out_loss_falling_from_above_chance_to_well_below_it_shows_learning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="kiln.train"):
        warn_learned_nothing_held_out(_eval_mode_at_chance([3.1, 2.6, 2.1, 1.8, 1.6, 1.5]), chance=math.log(10))
    assert not caplog.messages


def test_chance_level_is_known_for_kilns_own_cross_entropy_only() -> None:
    assert chance_loss(Task("classification"), 9) == pytest.approx(math.log(9))
    assert chance_loss(Task("classification", None, torch.nn.functional.cross_entropy), 9) is None
    assert chance_loss(Task("regression"), 0) is None
    assert chance_loss(Task("classification"), 1) is None


def test_a_training_loss_ending_far_above_chance_is_said_to_have_diverged(caplog: pytest.LogCaptureFixture) -> None:
    from kiln.stages.train.stage import warn_diverged

    def losses(*values: float) -> list[EpochMetrics]:
        return [EpochMetrics(i + 1, v, 1.0, 4, 1e-3) for i, v in enumerate(values)]

    chance = math.log(4)
    with caplog.at_level(logging.WARNING, logger="kiln.train"):
        warn_diverged(losses(7e16, 2e15), chance)
        assert "the training diverged; lower train.lr" in caplog.text
        caplog.clear()
        warn_diverged(losses(1.6, 0.4), chance)  # learned
        warn_diverged(losses(1.4, 1.39), chance)  # near chance: the learned-nothing checks' to judge
        warn_diverged(losses(7e16, 2e15), None)  # chance unknown (a user's loss, float targets)
        warn_diverged(losses(float("nan")), chance)
    assert not caplog.text
