"""kiln.core.compare: the one comparator, named statistics per output."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.core.compare import STATISTICS, compare_arrays, compare_outputs, within_tolerance, worst


def test_identical_outputs_are_perfect() -> None:
    x = np.random.default_rng(0).standard_normal((16, 10)).astype(np.float32)
    s = compare_arrays(x, x.copy())
    assert s.max_abs_err == 0 and s.rel_err == 0 and s.cosine == pytest.approx(1.0) and s.top1_agreement == 1.0
    assert set(s.as_dict()) == set(STATISTICS)


def test_statistics_name_what_changed() -> None:
    ref = np.random.default_rng(1).standard_normal((100, 10))
    got = ref.copy()
    got[:10] = -got[:10]  # flips the argmax of those rows
    s = compare_arrays(ref, got)
    assert s.top1_agreement == pytest.approx(0.9) and s.cosine < 0.9 and s.max_abs_err > 0


def test_non_finite_candidate_fails_every_statistic() -> None:
    ref = np.ones((4, 3))
    got = ref.copy()
    got[0, 0] = np.nan
    s = compare_arrays(ref, got)
    assert np.isnan(s.cosine) and s.max_abs_err == float("inf") and s.rel_err == float("inf")


def test_the_same_infinity_in_the_same_place_is_equal_and_a_moved_one_is_not() -> None:
    ref = np.array([[-np.inf, 1.0, 2.0], [3.0, -np.inf, 4.0]], np.float32)  # a -inf mask, as a model writes it
    stats = compare_arrays(ref, ref + np.float32(1e-3) * np.isfinite(ref))
    assert stats.rel_err == pytest.approx(1e-3 * np.sqrt(4) / np.sqrt(1 + 4 + 9 + 16), rel=1e-3)
    assert np.isfinite(stats.max_abs_err) and stats.cosine > 0.9999, stats
    moved = ref.copy()
    moved[0, :2] = moved[0, 1::-1]  # the infinity at another place
    assert compare_arrays(ref, moved).rel_err == np.inf and np.isnan(compare_arrays(ref, moved).cosine)
    assert compare_arrays(ref, np.where(np.isinf(ref), np.float32(np.inf), ref)).rel_err == np.inf  # another sign
    finite = np.nan_to_num(ref, neginf=-5.0)
    assert compare_arrays(ref, finite).rel_err == np.inf  # a finite value where the reference has none


def test_near_ties_agree_only_when_asked() -> None:
    ref = np.array([[1.0, 1.0 + 1e-6, 0.0]])
    got = np.array([[1.0 + 1e-6, 1.0, 0.0]])
    assert compare_arrays(ref, got).top1_agreement == 0.0
    assert compare_arrays(ref, got, rel_tie=1e-3).top1_agreement == 1.0


def test_outputs_without_a_class_axis_have_no_top1() -> None:
    assert compare_arrays(np.arange(4.0), np.arange(4.0)).top1_agreement is None


def test_top1_of_class_maps_is_over_their_channel_axis() -> None:
    """[N, C, H, W] segmentation logits: one pixel's class changes of two. Before, argmax ran over W (the last
    axis), and an INT8 U-Net's 'top-1 agreement' of 0.56 measured nothing."""
    ref = np.zeros((1, 3, 1, 2), np.float32)
    ref[0, 0, 0, 0] = ref[0, 1, 0, 1] = 1.0  # pixel 0 is class 0, pixel 1 class 1
    got = ref.copy()
    got[0, 2, 0, 1] = 2.0  # pixel 1 now class 2 (along W, the old axis, every row still peaks alike: 1.0)
    assert compare_arrays(ref, got).top1_agreement == 0.5


def test_per_output_and_worst() -> None:
    ref = {"hidden": np.ones((2, 3, 4)), "logits": np.eye(2)}
    got = {"hidden": np.ones((2, 3, 4)), "logits": np.array([[0.0, 1.0], [0.0, 1.0]])}
    stats = compare_outputs(ref, got)
    assert set(stats) == {"hidden", "logits"} and stats["hidden"].cosine == pytest.approx(1.0)
    assert worst(stats, "cosine") == stats["logits"].cosine and worst(stats, "max_abs_err") == 1.0
    positional = compare_outputs([ref["logits"]], [got["logits"]])
    assert set(positional) == {"0"}


def test_shape_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError, match="shapes differ"):
        compare_arrays(np.ones((2, 3)), np.ones((3, 2)))


@pytest.mark.parametrize(
    "got, ok",
    [
        (np.array([1.0, 2.0, np.nan]), True),
        (np.array([1.0, 2.1, np.nan]), False),
        (np.array([1.0, np.nan, 2.0]), False),
        (np.array([1.0, 2.0, np.inf]), False),
    ],
)
def test_within_tolerance_keeps_nan_and_inf_in_place(got: np.ndarray, ok: bool) -> None:
    assert within_tolerance(np.array([1.0, 2.0, np.nan]), got, atol=1e-6, rtol=1e-6)[0] is ok


def test_within_tolerance_integers_must_be_equal() -> None:
    assert within_tolerance(np.array([1, 2]), np.array([1, 2]), 0, 0)[0]
    assert not within_tolerance(np.array([1, 2]), np.array([1, 3]), 10, 10)[0]


def test_flips_on_planted_ties_are_ties_and_a_real_flip_is_not() -> None:
    """1,000 classes (a ResNet's head); a candidate off by FP16-like noise (1e-3 of a logit spread of 1). Rows whose
    two best classes were planted 1e-4 apart flip on that noise: ties, counted as agreeing. A row whose winner the
    candidate moves by 0.5 (the rest of the row as exact as elsewhere) is a real flip."""
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((64, 1000))
    top = ref.argmax(1)
    second = np.argsort(ref, axis=1)[:, -2]
    rows = np.arange(64)
    ref[rows[:8], second[:8]] = ref[rows[:8], top[:8]] - 1e-4  # planted ties in rows 0..7
    got = ref + rng.standard_normal(ref.shape) * 1e-3
    got[rows[:8], second[:8]] = ref[rows[:8], top[:8]] + 1e-3  # each tie flips, within the noise
    got[20, second[20]] = ref[20, top[20]] + 0.5  # a real flip: far beyond the row's noise
    s = compare_arrays(ref, got)
    assert s.top1_ties == pytest.approx(8 / 64) and s.top1_agreement == pytest.approx(63 / 64)
    broken = ref + rng.standard_normal(ref.shape)  # every logit off by the logits' own spread: no ties, only flips
    assert compare_arrays(ref, broken).top1_ties == 0.0


def test_few_classes_have_no_measured_ties() -> None:
    ref = np.array([[1.0, 1.0 - 1e-6, 0.0]])
    got = np.array([[1.0, 1.0 + 1e-6, 0.0]])
    s = compare_arrays(ref, got)
    assert s.top1_agreement == 0.0 and s.top1_ties == 0.0


def test_integer_and_boolean_outputs_are_compared_by_equal_values() -> None:
    labels = np.array([0, 3, 1, 2], np.int64)
    same = compare_arrays(labels, labels.copy())
    assert same.cosine is None and same.top1_agreement == 1.0 and same.max_abs_err == 0.0
    assert compare_arrays(labels, np.array([0, 3, 1, 1], np.int64)).top1_agreement == 0.75
    mask = np.array([[True, False], [True, True]])
    assert compare_arrays(mask, ~mask).top1_agreement == 0.0


def test_the_worst_sample_is_found_where_the_whole_output_hides_it() -> None:
    """One class map of 128 wrong moves the whole output's cosine by about 1/128; its own cosine shows it."""
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((128, 4, 8, 8))
    got = ref + 1e-3 * rng.standard_normal(ref.shape)
    got[77] = rng.standard_normal(ref.shape[1:])
    s = compare_arrays(ref, got)
    assert s.cosine > 0.99 and s.sample_cosine < 0.2 and s.worst_sample == 77
    assert compare_arrays(ref, ref).sample_cosine == pytest.approx(1.0)


def test_a_small_sample_is_held_to_the_error_a_typical_sample_may_have() -> None:
    """A near-zero reference row, and the same small error on every row: its own cosine is noise (here 0), the
    error measured at the median norm is not; a small row gone wrong by a typical sample's size still fails, and
    a scaled one (direction kept) passes, as its own cosine does."""
    from kiln.core.compare import sample_cosines

    rng = np.random.default_rng(1)
    ref = rng.standard_normal((16, 64))
    ref[3] *= 1e-5
    noise = 1e-3 * rng.standard_normal(ref.shape)
    got = ref + noise
    got[3] = 0.0  # lost in rounding
    cos = sample_cosines(ref, got)
    assert cos is not None and cos.min() > 0.9999 and cos[3] > 0.9999
    wrong = got.copy()
    wrong[3] = rng.standard_normal(64)  # a typical sample's values where there were none
    assert sample_cosines(ref, wrong)[3] < 0.6  # about 1 - 1/2: its error is a median sample's norm
    scaled = got.copy()
    scaled[5] = 0.3 * ref[5]  # the direction kept: a cosine of 1, however large the error
    assert sample_cosines(ref, scaled)[5] == pytest.approx(1.0)


def test_per_sample_cosine_needs_samples_of_several_finite_values() -> None:
    from kiln.core.compare import sample_cosines

    assert compare_arrays(np.arange(4.0), np.arange(4.0)).sample_cosine is None  # [N]: one value per sample
    assert compare_arrays(np.ones((4, 1)), np.ones((4, 1))).sample_cosine is None  # the cosine of a number: its sign
    assert compare_arrays(np.zeros((4, 3)), np.zeros((4, 3))).sample_cosine is None  # no norm to measure by
    ref = np.array([[-np.inf, 1.0, 2.0], [3.0, 4.0, 5.0]])
    got = ref + np.array([[0.0, 1e-3, 0.0], [0.0, 0.0, 0.0]])
    assert sample_cosines(ref, got).min() > 0.9999  # the same infinity in both is equal
    got[1, 0] = np.nan
    s = compare_arrays(ref, got)
    assert np.isnan(s.sample_cosine) and s.worst_sample == 1


def test_value_order_puts_tied_detections_in_one_order_and_leaves_what_agrees_as_it_came() -> None:
    """Equal scores in another order (ONNX Runtime's TopK) agree once ordered by value; boxes that agree as they
    came, with reduced precision's noise on close ones, are not reordered into a disagreement; an output of more
    than two axes (an RNN's time-major [T, B, H]) keeps its order, so steps reversed stay an error."""
    from kiln.core.compare import value_ordered

    boxes = np.array([[100.0, 0, 10, 10], [100.3, 50, 60, 60], [300, 0, 10, 10]], np.float32)
    scores = np.array([0.9, 0.9, 0.7], np.float32)
    ref = {"boxes": boxes, "scores": scores}
    swapped = {"boxes": boxes[[1, 0, 2]], "scores": scores[[1, 0, 2]]}
    r, g = value_ordered(ref, swapped, ["boxes", "scores"])
    assert np.array_equal(r["boxes"], g["boxes"]) and np.array_equal(r["scores"], g["scores"])
    noisy = {"boxes": boxes + np.array([[0.25, 0, 0, 0], [-0.25, 0, 0, 0], [0, 0, 0, 0]], np.float32), "scores": scores}
    r, g = value_ordered(ref, noisy, ["boxes", "scores"])
    assert np.abs(r["boxes"] - g["boxes"]).max() <= 0.25 + 1e-6  # compared as they came
    steps = np.random.default_rng(0).standard_normal((10, 4, 16)).astype(np.float32)
    r, g = value_ordered({"out": steps}, {"out": steps[::-1].copy()}, ["out"])
    assert np.abs(r["out"] - g["out"]).max() > 0.1


def _masked_logits(fill: float, share: float = 0.3, classes: int = 6) -> tuple[np.ndarray, np.ndarray]:
    """A policy's logits [80, classes], invalid actions filled with ``fill`` (action 0 always valid), and the
    positions filled."""
    rng = np.random.default_rng(3)
    mask = rng.random((80, classes)) < share
    mask[:, 0] = False
    logits = rng.standard_normal((80, classes)).astype(np.float32)
    return np.where(mask, np.float32(fill), logits), mask


@pytest.mark.parametrize("fill", [-1e9, float(np.finfo(np.float32).min), -1e4, -65504.0, -np.inf])
@pytest.mark.parametrize("share", [0.3, 0.9])  # most actions masked too: the median is a fill's then
def test_mask_fills_alike_in_both_are_set_aside_and_the_values_around_them_compared(fill: float, share: float) -> None:
    """A policy whose logits were halved: with a -inf mask, relative error 0.5; with a -1e9 mask the fills drowned
    it (6.5e-10) and the engine passed."""
    ref, mask = _masked_logits(fill, share)
    halved = np.where(mask, ref, ref / 2)
    s = compare_arrays(ref, halved)
    assert s.rel_err == pytest.approx(0.5, rel=1e-6) and 0.5 < s.max_abs_err < 3, s
    assert compare_arrays(ref, ref.copy()).rel_err == 0.0
    as_inf = np.where(mask, np.float32(-np.inf), ref)  # an FP16 engine's -inf for the fill: masked alike
    assert compare_arrays(ref, as_inf).max_abs_err == 0.0
    clamped = np.where(mask, np.float32(max(fill, -65504.0)), ref)  # an FP16 graph's clamp of a fill past its range
    assert compare_arrays(ref, clamped).rel_err == 0.0


def test_a_sample_whose_values_are_off_beside_its_mask_fills_is_the_worst() -> None:
    ref, mask = _masked_logits(-1e9)
    got = ref.copy()
    got[7] = np.where(mask[7], ref[7], -ref[7])
    s = compare_arrays(ref, got)
    assert s.worst_sample == 7 and s.sample_cosine < 0.9999, s


def test_a_mask_in_one_of_the_two_only_is_a_huge_error() -> None:
    ref, mask = _masked_logits(-1e9)
    got = ref.copy()
    row, col = np.argwhere(mask)[0]
    got[row, col] = 0.5  # the engine lets an invalid action through
    s = compare_arrays(ref, got)
    assert s.max_abs_err > 1e8 and s.rel_err > 0.5 and s.cosine < 0.9, s
    got = ref.copy()
    got[row, 0] = -1e9  # ...or masks a valid one
    assert compare_arrays(ref, got).max_abs_err > 1e8


def test_large_real_values_are_never_mask_fills() -> None:
    """Values all near 1e6 (a regression's), a lone large value among small ones, and integer outputs hold no mask
    fill: their errors count."""
    from kiln.core.compare import masks_of

    rng = np.random.default_rng(0)
    level = (1e6 + 1e3 * rng.standard_normal((80, 3))).astype(np.float32)
    assert masks_of(level).values == ()
    assert compare_arrays(level, level * np.float32(1.01)).rel_err == pytest.approx(0.01, rel=1e-3)
    lone = rng.standard_normal((80, 3))
    lone[5, 1] = -2e4
    assert masks_of(lone).values == ()
    got = lone.copy()
    got[5, 1] = -4e4
    assert compare_arrays(lone, got).max_abs_err == 2e4
    ids = np.full((8, 4), 50256, np.int64)  # an end-of-text token id: an integer, compared exactly
    assert masks_of(ids).values == ()


def test_agreement_within_a_tolerance_is_scaled_by_the_values_compared() -> None:
    """The same -inf in both is equal (not NaN, not wrong); a -1e9 fill does not make the tolerance 1e5."""
    from kiln.core.compare import agrees

    row = np.array([[0.3, -1.2, -np.inf, 0.8, -np.inf]], np.float32)
    assert agrees(row, row.copy(), 1e-5, 1e-4) == (True, 0.0)
    big = np.where(np.isinf(row), np.float32(-1e9), row)
    ok, err = agrees(big, np.where(np.isinf(row), big, big / 2), 1e-5, 1e-4)
    assert not ok and err == pytest.approx(0.6)
    nan = row.copy()
    nan[0, 0] = np.nan
    assert agrees(row, nan, 1e-5, 1e-4) == (False, float("inf"))


def test_a_mask_fill_makes_no_flip_a_tie() -> None:
    """``rel_tie`` is relative to the values compared: with a -1e9 fill it excused every flip."""
    ref = np.array([[1.0, 0.5, -1e9, -1e9], [0.2, 1.0, -1e9, -1e9]])
    got = np.array([[0.5, 1.0, -1e9, -1e9], [0.2, 1.0, -1e9, -1e9]])
    assert compare_arrays(ref, got, rel_tie=1e-3).top1_agreement == 0.5


def test_the_tolerance_of_an_output_with_a_mask_fill_is_scaled_by_its_values() -> None:
    """The optimizer's and the export's check: a -1e9 fill made ``rtol * max|ref|`` 1e5."""
    ref, mask = _masked_logits(-1e9)
    assert within_tolerance(ref, ref.copy(), atol=1e-5, rtol=1e-4)[0]
    ok, err, why = within_tolerance(ref, np.where(mask, ref, ref / 2), atol=1e-5, rtol=1e-4)
    assert not ok and 0.5 < err < 3 and "max abs error" in why


def test_large_values_that_repeat_in_a_sparse_output_are_compared_not_set_aside() -> None:
    """Box areas of 16384 beside zeros (a padded list) are values: an engine's 81920 for them is an error, though a
    -inf for a -1e9 fill still masks alike."""
    ref = np.zeros((8, 100), np.float32)
    ref[:, :3], ref[:7, 3] = 16384, np.arange(1, 8)
    got = ref.copy()
    got[:, :3] = 81920
    assert compare_arrays(ref, got).max_abs_err == 65536
    fill = np.random.default_rng(0).normal(size=(10, 6)).astype(np.float32)
    fill[:, :2] = -1e9
    overflowed = fill.copy()
    overflowed[:, :2] = -np.inf
    assert compare_arrays(fill, overflowed).max_abs_err == 0
