"""Dense class logits that one class dominates: the agreement of each class the reference predicts."""

import numpy as np

from kiln.core.compare import class_agreement, compare_arrays


def dominated_volume(rare_flipped: float) -> tuple[np.ndarray, np.ndarray]:
    """Logits [2, 3, 8, 16, 16]: class 0 nearly everywhere, class 2 in a block of 256 voxels, of which the
    candidate says background at ``rare_flipped`` of them."""
    rng = np.random.default_rng(0)
    ref = rng.normal(0, 0.1, (2, 3, 8, 16, 16))
    ref[:, 0] += 3.0
    ref[0, 2, :4, :8, :8] += 6.0  # 256 voxels of class 2 (of 4096)
    got = ref.copy()
    idx = np.argwhere(ref[0].argmax(0) == 2)[: int(rare_flipped * 256)]
    got[0, 0, idx[:, 0], idx[:, 1], idx[:, 2]] += 10.0
    return ref, got


def test_worst_class_agreement_is_the_rare_class_recall() -> None:
    ref, got = dominated_volume(0.25)
    found = class_agreement(ref, got)
    assert found is not None
    assert found.worst_class == 2
    assert abs(found.worst_class_agreement - 0.75) < 1e-9
    assert found.top_class_share > 0.9
    # the overall agreement hides it: 64 of 4096 voxels
    assert compare_arrays(ref, got).top1_agreement > 0.96


def test_no_dominant_class_or_logits_per_row_have_none() -> None:
    rng = np.random.default_rng(1)
    balanced = rng.normal(0, 1, (2, 3, 4, 16, 16))
    assert class_agreement(balanced, balanced) is None
    rows = rng.normal(0, 1, (500, 3))
    rows[:, 0] += 10
    assert class_agreement(rows, rows) is None


def test_where_limits_the_positions() -> None:
    ref, got = dominated_volume(0.25)
    where = ref.argmax(1) != 2  # no position of the rare class counted
    assert class_agreement(ref, got, where) is None or class_agreement(ref, got, where).worst_class != 2
