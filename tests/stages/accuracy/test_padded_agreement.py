"""Top-1 agreement without labels leaves out the positions an attention mask marks as padding, which
``without_padding`` zeroes in both the reference and the candidate."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.core.labels import without_padding
from kiln.stages.accuracy.check import compare_all


def padded_logits(classes: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Unsure logits [4, 6, classes] (no position confident) with half of each row padding, and a candidate whose
    argmax differs from the reference's at one real position in four."""
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((4, 6, classes)).astype(np.float32) * 0.01
    got = ref.copy()
    flip = np.zeros((4, 6), bool)
    flip[:, 0] = True  # one real position in each row's three
    top = ref.argmax(-1)
    rows, cols = np.nonzero(flip)
    got[rows, cols, (top[rows, cols] + 1) % classes] += 1.0
    mask = np.ones((4, 6), np.int64)
    mask[:, 3:] = 0
    return {"attention_mask": mask}, {"logits": ref}, {"logits": got}


@pytest.mark.parametrize("classes", [2, 5])
def test_padded_positions_do_not_count_as_agreeing(classes: int) -> None:
    feed, ref, got = padded_logits(classes)
    stats = compare_all(without_padding(feed, ref), without_padding(feed, got), "logits")
    # 4 of the 12 real positions flipped: 8/12, not (8 + 12 padded) / 24
    assert stats["logits"].top1_agreement == pytest.approx(8 / 12)


def test_unpadded_logits_count_every_position() -> None:
    feed, ref, got = padded_logits(5)
    stats = compare_all(ref, got, "logits")
    assert stats["logits"].top1_agreement == pytest.approx(20 / 24)
