"""A binary classifier's one logit ([N, 1] class logits): its top-1 agreement is that of its decision, the logit
above 0 (a sigmoid's probability above 0.5), with flips on ties counted as agreeing as for class logits of more
entries; a regression's [N, 1] values, compared without ``binary_at``, have no top-1 at all."""

from __future__ import annotations

import numpy as np

from kiln.core.compare import compare_arrays, compare_outputs

LOGITS = np.array([[2.0], [-1.5], [0.3], [-0.2], [1.0], [-3.0], [0.8], [-0.9]], dtype=np.float32)


def test_a_binary_logit_agrees_on_its_decision_and_a_regression_column_has_none() -> None:
    """Two of eight decisions flipped (the sign of the logit) and a third logit moved without crossing 0."""
    got = LOGITS.copy()
    got[2], got[3], got[4] = -0.1, 0.05, 0.2
    stats = compare_arrays(LOGITS, got, binary_at=0.0)
    assert stats.top1_agreement == 6 / 8 and stats.top1_ties == 0.0
    assert compare_arrays(LOGITS, LOGITS, binary_at=0.0).top1_agreement == 1.0
    assert compare_arrays(LOGITS, got).top1_agreement is None  # a value per row, not known to be a logit


def test_a_flip_of_a_logit_within_the_tie_tolerance_of_its_threshold_counts_as_agreeing() -> None:
    """As for two classes: a flip where the reference's logit lies within ``rel_tie`` of its largest magnitude of
    the threshold is a tie, counted as agreeing and counted apart; one beyond it is a disagreement."""
    ref = np.array([[3.0], [0.002], [-1.0], [0.5]])
    got = np.array([[3.0], [-0.001], [-1.0], [0.5]])
    tie = compare_arrays(ref, got, rel_tie=1e-3, binary_at=0.0)  # 0.002 <= 1e-3 * 3
    assert tie.top1_agreement == 1.0 and tie.top1_ties == 1 / 4
    flip = compare_arrays(ref, got, rel_tie=1e-4, binary_at=0.0)
    assert flip.top1_agreement == 3 / 4 and flip.top1_ties == 0.0


def test_a_sigmoid_probability_decides_at_its_threshold() -> None:
    """Probabilities decide at 0.5: 0.4 -> 0.55 flips, 0.9 -> 0.6 does not."""
    ref = np.array([[0.9], [0.4], [0.6], [0.1]])
    got = np.array([[0.6], [0.55], [0.6], [0.1]])
    assert compare_arrays(ref, got, binary_at=0.5).top1_agreement == 3 / 4
    assert compare_arrays(ref, got, binary_at=0.0).top1_agreement == 1.0  # all above 0: no decision changes


def test_only_the_outputs_named_binary_get_a_decision_agreement() -> None:
    """A click logit and a value beside it, both [N, 1]: only the one given a threshold is held to a decision."""
    ref = {"click": LOGITS, "value": LOGITS}
    got = {"click": -LOGITS, "value": -LOGITS}
    stats = compare_outputs(ref, got, binary_at={"click": 0.0})
    assert stats["click"].top1_agreement == 0.0 and stats["value"].top1_agreement is None


def test_one_logit_per_row_without_a_class_axis_agrees_on_its_decision() -> None:
    """A two-tower model's score ``[N]`` (``(u * v).sum(-1)``), given a threshold, is held to its decision as the
    same logits ``[N, 1]`` are; without one it stays a value per row with no top-1."""
    ref, got = LOGITS[:, 0], LOGITS[:, 0].copy()
    got[2], got[3], got[4] = -0.1, 0.05, 0.2
    flat = compare_arrays(ref, got, binary_at=0.0)
    column = compare_arrays(LOGITS, got[:, None], binary_at=0.0)
    assert flat.top1_agreement == column.top1_agreement == 6 / 8 and flat.top1_ties == 0.0
    assert compare_arrays(ref, got).top1_agreement is None
    probabilities = np.array([0.9, 0.4, 0.6, 0.1])
    assert compare_arrays(probabilities, np.array([0.6, 0.55, 0.6, 0.1]), binary_at=0.5).top1_agreement == 3 / 4
