"""The comparator: a candidate's outputs against a reference's, as named statistics per output (like
Polygraphy's ``Comparator``).

Every place that judges outputs goes through here and names the statistic it uses: validation gates and the
precision stage's acceptance of a variant hold ``cosine`` and the worst sample's (``sample_cosine``) to
``min_cosine``, and ``top1_agreement`` to ``min_top1_agreement``; the ORT autotuner compares candidates by
``cosine``. The optimizer's safety net asks a different question, "equal within tolerance?", answered by
:func:`within_tolerance`.
"""

from __future__ import annotations

import warnings
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np

# statistic -> what it measures (for docs, reports and error messages)
STATISTICS: dict[str, str] = {
    "max_abs_err": "largest absolute difference (inf when the candidate has non-finite values)",
    "rel_err": "relative L2 error ||got - ref|| / ||ref||; in validation, of every float output with a batch axis "
    "but the class logits, the RMS error over how the reference varies between the held-out samples (at least 1 % "
    "of its RMS)",
    "norm_rel_err": "where rel_err is over the spread between samples, the relative L2 error over the norm",
    "cosine": "cosine similarity of the whole output, flattened (1.0 when both are all zeros); none for an output "
    "without a batch axis (a 0-D loss: one value a call, whose cosine is its sign)",
    "sample_cosine": "the worst sample's cosine: each sample (row of the batch axis) flattened against its reference "
    "row, or where higher, the cosine its error would give on a sample of the median norm (a near-zero sample's own "
    "cosine is noise: sample_cosines)",
    "worst_sample": "the row of the batch axis that sample_cosine comes from",
    "top1_agreement": "fraction of rows whose argmax over the class axis agrees (the last; axis 1 of [N, C, H, W] "
    "maps), a flip on a tie counting as agreement; of class logits with a class axis of one entry, or of one value "
    "per row (a binary classifier's one logit, [N, 1] or [N]), the agreement of its decision, the logit above its "
    "threshold; of a multi-label head's logits (agreement 'decision'), the share of (sample, label) pairs whose "
    "decision agrees",
    "top1_ties": "fraction of rows whose argmax flipped on a tie: the reference's margin between the two classes "
    "within the candidate's own, small error on that row (TIE_SIGMAS robust deviations of its error on the other "
    "classes, at most TIE_MAX_NOISE of the row's spread)",
    "top_class_share": "of dense class logits (positions besides the batch), the share of the positions the top-1 "
    "agreement counts at which the reference's top class is its most frequent one; recorded where over DOMINANT_CLASS",
    "worst_class": "of such logits, the class the reference predicts whose positions agree least (class_agreement)",
    "worst_class_agreement": "that class's agreement: the share of the positions where the reference says it at "
    "which the candidate says it too (its recall), over every position (or the labelled ones), ties agreeing",
    "systematic_err": "the systematic part of the error, of the least-squares line of the candidate's values on the "
    "reference's: sqrt((slope - 1)^2 + (shift / d)^2), d what rel_err is over (the spread between samples, or the "
    "RMS), less what noise alone puts on the line (systematic); none for an output without a batch axis or of "
    "integer categories",
    "slope": "the slope of that line: the candidate's values over the reference's (1.0: no scale error)",
    "shift": "the mean of candidate - reference, in the output's own units (0.0: no offset)",
    "levels": "of an integer output that holds levels of a quantity (integer_levels: uint8 pixel values), its count "
    "of distinct values; it is then held to its error as a float output is, not to its share of equal values",
}
# A flip is a tie when the reference's margin between its class and the candidate's is at most this many robust
# standard deviations (1.4826 x the median absolute error) of the candidate's error on the row's other classes.
TIE_SIGMAS = 3.0
TIE_MIN_CLASSES = 4  # the noise is measured on the classes a flip does not involve: at least two of them
# ...and only where that error is small beside the row's own spread of logits (its standard deviation): an engine
# whose every logit is off (an overflow, a broken kernel) has no ties, only flips.
TIE_MAX_NOISE = 0.01
HIGHER_IS_BETTER = {"cosine", "sample_cosine", "top1_agreement"}
# What an output's top1_agreement counts: "top1", the argmax of each row (a binary classifier's one logit: its
# decision); "decision", a multi-label head's decision per (sample, label) pair, each label's logit above 0
Agreement = Literal["top1", "decision"]
# How reports and failures name each: one name for the figure that min_top1_agreement holds
AGREEMENT_NAMES: dict[str, str] = {
    "top1": "top-1 agreement",
    "decision": "decision agreement (per label: logit > 0, or > 0.5 for probabilities)",
}
# A mask's fill (-1e9, torch.finfo(dtype).min, -1e4 on a policy's invalid actions or a decoder's banned tokens) is no
# value to compare: a finite value of at least MASK_MIN, and MASK_RATIO times the median magnitude of the output's
# other values, that the reference holds in two places or more (masks_of). An output of large values (a
# regression's, all near 1e6) has a median as large, and none.
MASK_MIN = 1e4
MASK_RATIO = 1e3
# An integer output holds levels of a quantity (an image's uint8 pixel values, a quantized signal, a count), not
# categories (class ids, token ids, a mask), where its reference holds at least LEVELS_MIN distinct values that fill
# at least LEVELS_FILL of the range between its smallest and largest: one level off is then a small error (FP16's
# 4e-4 on a tanh image rounds a pixel to its neighbour), where a class id one off is a wrong answer. Ids rarely
# qualify: a vocabulary's or ImageNet's are sparse over their range, and few tasks have 100 classes or more.
LEVELS_MIN = 100
LEVELS_FILL = 0.5
# Dense class logits whose reference says one class at more than this share of the positions counted (a volume's
# background) have a top-1 agreement that class alone decides: each class's own agreement is measured too
DOMINANT_CLASS = 0.9


@dataclass(frozen=True)
class OutputStats:
    """The statistics of one output. ``top1_agreement`` is None for outputs without a class axis (rank < 2), or with
    one of a single entry, unless it is a binary classifier's logit (:func:`compare_arrays`'s ``binary_at``). An
    integer or boolean output (a predicted class, a mask) has no cosine: its ``top1_agreement`` is the share of its
    values that are equal, the decision a class output makes; an integer output of levels (:func:`integer_levels`:
    pixel values) is compared as a float output is instead, with no top-1, and ``levels`` counts its values.
    ``sample_cosine`` is None where there are no samples to tell apart (:func:`sample_cosines`). An output without a
    batch axis (``whole``: a 0-D loss, one value a call) has no cosine either, and no top-1: the cosine of one value
    is its sign, 1.0 whatever the scale; its ``rel_err`` is over its norm. ``agreement`` says
    what ``top1_agreement`` counts (:data:`Agreement`): the comparison of a multi-label head sets "decision"; it is
    no statistic, and :meth:`as_dict` leaves it out."""

    max_abs_err: float
    rel_err: float
    cosine: float | None
    top1_agreement: float | None
    top1_ties: float | None = None  # of the rows, those that flipped on a tie (counted as agreeing above)
    sample_cosine: float | None = None  # the worst sample's cosine (NaN: a sample with a non-finite value)
    worst_sample: int | None = None  # which row of the batch axis that is
    norm_rel_err: float | None = None  # the error over the output's norm, where rel_err is over something else
    levels: int | None = None  # an integer output of levels: its count of distinct values (None: any other output)
    top_class_share: float | None = None  # dense class logits one class dominates: that class's share (class_agreement)
    worst_class: int | None = None  # ...the class the reference predicts that agrees least
    worst_class_agreement: float | None = None  # ...and its agreement (recall)
    agreement: Agreement = "top1"
    systematic_err: float | None = None  # the error's systematic part (systematic), over what rel_err is over
    slope: float | None = None  # ...the slope of the line of the candidate's values on the reference's
    shift: float | None = None  # ...and the mean error, in the output's units

    def as_dict(self) -> dict[str, float | None]:
        """The statistics (:data:`STATISTICS`) by name, as records keep them: numbers only."""
        stats = asdict(self)
        del stats["agreement"]
        return stats


def compare_arrays(
    ref: np.ndarray,
    got: np.ndarray,
    rel_tie: float = 0.0,
    where: np.ndarray | None = None,
    binary_at: float | None = None,
    levels: bool | None = None,
    whole: bool = False,
) -> OutputStats:
    """``got`` against ``ref`` (same shape). ``rel_tie``: a top-1 mismatch where the reference's two logits lie
    within ``rel_tie`` of its largest magnitude is a tie, not a disagreement (random weights give near-ties that
    FP16 legitimately flips). ``where``: top-1 agreement over these rows/positions only (a boolean array shaped like
    the logits without their class axis: the labelled tokens of a token classifier, not its padding).
    ``binary_at``: the output holds class logits, and a class axis of one entry is a binary classifier's one logit,
    whose decision is the value above ``binary_at`` (0 for a logit, 0.5 for a sigmoid's probability): its top-1
    agreement is that decision's (:func:`_top1`), as is that of one logit per row without a class axis (``[N]``).
    None: a class axis of one entry, or one value per row, has no top-1 (a regression's ``[N, 1]`` or ``[N]``
    values). ``levels``: whether an integer ``ref`` holds levels of a quantity, compared as a float output
    (None: as :func:`integer_levels` reads its values); any other integer or boolean output is compared value for
    value (:class:`OutputStats`). ``whole``: the output has no batch axis (a 0-D loss; where calls were stacked,
    one value a call), its values no samples' rows: no cosine, per-sample cosine or top-1 (as a 0-D ``ref``)."""
    count = _levels(ref, levels)
    r, g = np.asarray(ref, dtype=np.float64), np.asarray(got, dtype=np.float64)
    if r.shape != g.shape:
        raise ValueError(f"output shapes differ: reference {list(r.shape)}, candidate {list(g.shape)}")
    if np.asarray(ref).dtype.kind in "iub" and count is None:
        equal = float(np.mean(r == g)) if r.size else 1.0
        return OutputStats(_max_abs_err(r, g), _rel_err(r, g), None, equal)
    shared = set_aside(r, g)
    rf, gf = (r[~shared], g[~shared]) if shared.any() else (r, g)
    if whole or r.ndim == 0:
        return OutputStats(_max_abs_err(rf, gf), _rel_err(rf, gf), None, None, levels=count)
    with np.errstate(invalid="ignore"):  # an infinity minus itself: NaN, which is no tie and no agreement
        agreement, ties = (None, None) if count else _top1(r, g, rel_tie, where, shared, binary_at)
    sample, row = _worst_sample(sample_cosines(r, g, shared))
    errors = _max_abs_err(rf, gf), _rel_err(rf, gf)
    line = systematic_of(r, g, float(np.sqrt(np.mean(rf**2))) if rf.size else 0.0, ~shared if shared.any() else None)
    return OutputStats(*errors, _cosine(rf, gf), agreement, ties, sample, row, levels=count, **line)


# The fewest values a line through (reference, candidate) is fitted to: two fix any line, and the noise on it is
# measured on the rest
SYSTEMATIC_MIN_VALUES = 3
# The fewest samples (rows of the batch axis): an engine's noise is often shared by a sample's values (one pooled
# feature feeds them all), so the noise a line may pick up is measured between samples, which needs a few
SYSTEMATIC_MIN_ROWS = 8
# Of the fitted slope and mean error, this many standard errors (from the rest of the error, the noise) are what noise
# alone may give, and are not counted as systematic: a small or noisy output is not called biased by its noise
SYSTEMATIC_SIGMAS = 2.0


@dataclass(frozen=True)
class Systematic:
    """The line a candidate's values follow against the reference's (:func:`systematic`): its ``slope`` and
    ``shift`` (the mean of candidate - reference), and the squares of the scale error (slope - 1) and of the shift
    with what noise alone may give each taken off (``scale_sq``, ``shift_sq``: :data:`SYSTEMATIC_SIGMAS`)."""

    slope: float
    shift: float
    scale_sq: float
    shift_sq: float

    def size(self, over: float) -> float:
        """The systematic error ``over`` a scale of the output (its spread between samples, or its RMS):
        sqrt((slope - 1)^2 + (shift / over)^2), a scale error counted as the share it scales every value by, and
        the mean error as its share of that scale."""
        return float(np.sqrt(self.scale_sq + self.shift_sq / max(over, 1e-12) ** 2))


def systematic(ref: np.ndarray, got: np.ndarray, kept: np.ndarray | None = None) -> Systematic | None:
    """The systematic part of ``got - ref`` (one shape, the batch axis first; ``kept``: the values compared, None:
    all): the least-squares line got = a ref + b, as its slope a and its mean error, mean(got - ref), which the
    centred fit keeps apart. Rounding and quantization noise scatters around got = ref; a wrong scale (a calibrated
    range off, a normalization lost) or offset (a bias dropped) moves every sample alike, which cosine cannot see (a
    scale keeps the direction) and rel_err's noise allowance lets through. The slope is a share of every value, not
    of their spread: values on levels far above how they vary, of both signs (a random model's), scaled by 0.1 % are
    0.1 % off. The mean error is in the output's units: where the values sit on a level of one sign (a forecast of
    a series around 300), a scale moves their mean too, and that counts over the spread as any offset does, since
    it moves every prediction by as much. What noise alone may put on each is taken off
    (:data:`SYSTEMATIC_SIGMAS` standard errors of the fitted slope and mean, from the rest of the error, counted
    between samples where a sample's values share their noise). None: a 0-D output, under
    :data:`SYSTEMATIC_MIN_VALUES` values or :data:`SYSTEMATIC_MIN_ROWS` samples, or a value not finite."""
    r, g = np.asarray(ref, dtype=np.float64), np.asarray(got, dtype=np.float64)
    if r.ndim == 0 or r.size < SYSTEMATIC_MIN_VALUES:
        return None
    rows = None if kept is None else np.nonzero(kept)[0]  # each kept value's sample, in r[kept]'s order
    r, g = (r.reshape(len(r), -1), g.reshape(len(g), -1)) if kept is None else (r[kept], g[kept])
    n, samples = r.size, len(r) if rows is None else int(np.count_nonzero(np.bincount(rows)))
    if (
        n < SYSTEMATIC_MIN_VALUES
        or samples < SYSTEMATIC_MIN_ROWS
        or not (np.isfinite(r).all() and np.isfinite(g).all())
    ):
        return None
    err, centred = g - r, r - r.mean()
    var, shift = float(np.mean(centred**2)), float(np.mean(err))
    tilt = float(np.mean(err * centred)) / var if var > 0 else 0.0  # slope - 1
    rest = err - tilt * centred - shift  # the noise around the line
    each = max(float(np.mean(rest**2)), 0.0) / (n - 2)  # the variance of a mean of n values of independent noise
    shared = samples / max(samples - 1, 1) / n**2  # of the same mean, noise shared within samples (clustered)
    shift_var = max(each, shared * _per_sample_sq(rest, rows))
    tilt_var = max(each, shared * _per_sample_sq(centred * rest, rows) / var) / var if var > 0 else 0.0
    sigmas = SYSTEMATIC_SIGMAS**2
    return Systematic(1.0 + tilt, shift, max(tilt**2 - sigmas * tilt_var, 0.0), max(shift**2 - sigmas * shift_var, 0.0))


def _per_sample_sq(values: np.ndarray, rows: np.ndarray | None) -> float:
    """The sum over samples of the square of each sample's sum of ``values`` (``[samples, values]``, or flat with
    each value's sample in ``rows``): a cluster-robust variance's middle term."""
    sums = values.sum(axis=1) if rows is None else np.bincount(rows, weights=values)
    return float(np.sum(sums**2))


def systematic_of(
    ref: np.ndarray, got: np.ndarray, over: float, kept: np.ndarray | None = None
) -> dict[str, float | None]:
    """:class:`OutputStats`' ``systematic_err`` (:meth:`Systematic.size` ``over`` the given scale: the output's RMS,
    or its spread between samples), ``slope`` and ``shift``; each None where there is no line to fit."""
    line = systematic(ref, got, kept)
    if line is None:
        return {"systematic_err": None, "slope": None, "shift": None}
    return {"systematic_err": line.size(over), "slope": line.slope, "shift": line.shift}


def integer_levels(ref: np.ndarray) -> int | None:
    """The count of distinct values of an integer output that holds levels of a quantity (:data:`LEVELS_MIN`
    values or more, filling :data:`LEVELS_FILL` of their range or more: uint8 pixel values), else None (a float or
    boolean output, or integers that are categories: class or token ids, a mask, few values)."""
    a = np.asarray(ref)
    if a.dtype.kind not in "iu" or a.size < LEVELS_MIN:
        return None
    values = np.unique(a)
    span = float(values[-1]) - float(values[0]) + 1.0
    return len(values) if len(values) >= LEVELS_MIN and len(values) >= LEVELS_FILL * span else None


def _levels(ref: np.ndarray, levels: bool | None) -> int | None:
    """The count of distinct values of an integer ``ref`` compared as levels (``levels``; None: where
    :func:`integer_levels` finds it holds them), else None."""
    if levels is None or np.asarray(ref).dtype.kind not in "iu":
        return integer_levels(ref)
    return len(np.unique(ref)) if levels else None


def max_abs_err(ref: np.ndarray, got: np.ndarray, masks: Masks | None = None) -> float:
    """The largest abs difference of two arrays of one shape, as :func:`compare_arrays` counts it: the values both
    hold alike (:func:`set_aside`) are equal; a value not finite in one of them only, an infinite error."""
    r, g = np.asarray(ref, dtype=np.float64), np.asarray(got, dtype=np.float64)
    shared = set_aside(r, g, masks)
    return _max_abs_err(r[~shared], g[~shared])


@dataclass(frozen=True)
class Masks:
    """An output's mask fills (:func:`masks_of`): the reference's values in ``values``, and its infinities, mask;
    a candidate's value masks alike where it has their sign and a magnitude of ``floor`` or more."""

    values: tuple[float, ...]
    floor: float


def masks_of(ref: np.ndarray) -> Masks:
    """The mask fills of a reference output: finite values of :data:`MASK_MIN` or more, and :data:`MASK_RATIO`
    times the median magnitude of its other finite values, that it holds in two places or more (a mask's constant
    repeats; a real value that large is a lone outlier). ``floor``: that bound, from which a candidate's value of
    the same sign masks too (an FP16 engine's -inf for -1e9). An output of such values only has no other values to
    measure them by, and no mask fills."""
    if np.asarray(ref).dtype.kind != "f":  # an integer output (a token id) is compared exactly: no mask
        return Masks((), MASK_MIN)
    r = np.asarray(ref, dtype=np.float64).ravel()
    finite = r[np.isfinite(r)]
    big, counts = np.unique(finite[np.abs(finite) >= MASK_MIN], return_counts=True)
    repeated = big[counts >= 2]
    if not repeated.size and not np.isinf(r).any():
        return Masks((), MASK_MIN)  # nothing masks: the floor is never read
    rest = finite[~np.isin(finite, repeated)] if repeated.size else finite
    if not rest.size:
        return Masks((), MASK_MIN)
    nonzero = rest[rest != 0]  # a sparse output's zeros (a padded box list) would make any large value a fill
    floor = max(MASK_MIN, MASK_RATIO * float(np.median(np.abs(nonzero if nonzero.size else rest))))
    return Masks(tuple(float(v) for v in repeated if abs(v) >= floor), floor)


FP16_MAX = 65504.0  # the largest finite FP16 value, where an FP16 graph clamps a larger fill


def set_aside(ref: np.ndarray, got: np.ndarray, masks: Masks | None = None) -> np.ndarray:
    """Where ``ref`` and ``got`` (one shape) hold alike a value that is no number to compare, as a boolean array:
    a NaN in both, or a mask in both (the reference's infinity or mask fill, :func:`masks_of`; the candidate's value
    of the same sign within a factor of 2 of the fill, FP16's largest value for a fill past it, or an infinity): a
    masked action is masked alike whether it
    reads -1e9 or -inf, and the fill's size would otherwise drown every error of the values around it. A mask in
    one of them only stays, a huge or infinite error. ``masks``: the reference's (default: read from ``ref``; a
    caller comparing one row at a time reads them from all its rows)."""
    r, g = np.asarray(ref, dtype=np.float64), np.asarray(got, dtype=np.float64)
    m = masks_of(ref) if masks is None else masks
    shared = np.isnan(r) & np.isnan(g)
    masked = np.isinf(r) | np.isin(r, m.values) if m.values else np.isinf(r)
    if masked.any():  # the candidate's value within a factor of 2 of the fill, or an infinity
        with np.errstate(invalid="ignore"):
            a = np.abs(g)
            near = np.isinf(g) | np.where(np.isinf(r), a >= m.floor, (a >= 0.5 * np.abs(r)) & (a <= 2 * np.abs(r)))
            # a fill past FP16's range comes out of an FP16 graph clamped to its largest value (-65504 for -1e9)
            near |= (np.abs(r) > FP16_MAX) & (a >= 0.5 * FP16_MAX)
        shared |= masked & (np.sign(g) == np.sign(r)) & near
    return shared


def agrees(
    ref: np.ndarray, got: np.ndarray, atol: float, rtol: float, masks: Masks | None = None
) -> tuple[bool, float]:
    """Whether ``got`` equals ``ref`` (one shape) within ``atol + rtol`` times the largest magnitude of the
    reference's values compared, and the largest error: beside the values both hold alike (:func:`set_aside`),
    and scaled by no mask fill (a -1e9 would make the tolerance 1e5). A value not finite in one of them only is an
    infinite error, never within. ``masks``: as for :func:`set_aside`."""
    r, g = np.asarray(ref, dtype=np.float64), np.asarray(got, dtype=np.float64)
    m = masks_of(ref) if masks is None else masks
    shared = set_aside(r, g, m)
    err = _max_abs_err(r[~shared], g[~shared])
    compared = ~shared & np.isfinite(r) & ~np.isin(r, m.values)
    scale = float(np.max(np.abs(r[compared]), initial=0.0))
    return bool(err <= atol + rtol * scale), err


def compare_outputs(
    ref: Mapping[str, np.ndarray] | Sequence[np.ndarray],
    got: Mapping[str, np.ndarray] | Sequence[np.ndarray],
    rel_tie: float = 0.0,
    where: Mapping[str, np.ndarray] | None = None,
    binary_at: Mapping[str, float] | None = None,
    levels: Collection[str] | None = None,
    whole: Collection[str] = (),
) -> dict[str, OutputStats]:
    """Per output: by name for mappings (the reference's names), by position (``"0"``, ``"1"``...) for sequences.
    ``where``: per output (by those names), the rows/positions its top-1 agreement counts; ``binary_at``: per output,
    the decision threshold of a binary classifier's one logit; ``levels``: the integer outputs that hold levels of
    a quantity (None: each as its values say); ``whole``: the outputs without a batch axis (:func:`compare_arrays`)."""
    where, binary_at = where or {}, binary_at or {}
    held = (lambda name: None) if levels is None else (lambda name: name in levels)
    if isinstance(ref, Mapping):
        got_map = got if isinstance(got, Mapping) else dict(zip(ref, got))
        pairs = {name: (value, got_map[name]) for name, value in ref.items()}
    else:
        pairs = {str(i): (r, g) for i, (r, g) in enumerate(zip(ref, got))}
    return {
        name: compare_arrays(r, g, rel_tie, where.get(name), binary_at.get(name), held(name), name in whole)
        for name, (r, g) in pairs.items()
    }


def worst(stats: Mapping[str, OutputStats], statistic: str) -> float:
    """The worst value of ``statistic`` over the outputs that have it (NaN counts as worst)."""
    values = [v for s in stats.values() if (v := getattr(s, statistic)) is not None]
    if not values:
        return float("nan")
    if any(np.isnan(v) for v in values):
        return float("nan")
    return min(values) if statistic in HIGHER_IS_BETTER else max(values)


def within_tolerance(ref: np.ndarray, got: np.ndarray, atol: float, rtol: float) -> tuple[bool, float, str]:
    """Is ``got`` equal to ``ref`` within ``atol + rtol * max|ref|`` (of the reference's values beside a mask's fill,
    :func:`masks_of`: a -1e9 would make the tolerance 1e5)? NaNs and infinities must sit in the same places;
    integer outputs must be equal. Returns (ok, max abs error, reason when not ok)."""
    if got.shape != ref.shape or got.dtype != ref.dtype:
        return False, float("inf"), f"{got.dtype}{list(got.shape)} vs {ref.dtype}{list(ref.shape)}"
    if not np.issubdtype(ref.dtype, np.inexact):
        return (True, 0.0, "") if np.array_equal(got, ref) else (False, float("inf"), "(integer) differs")
    if not np.array_equal(np.isnan(got), np.isnan(ref)):
        return False, float("inf"), "has NaNs in different places"
    ref64, got64 = ref.astype(np.float64), got.astype(np.float64)
    finite = np.isfinite(ref64)
    if not np.array_equal(got64[~finite], ref64[~finite], equal_nan=True):  # an inf must stay the same inf
        return False, float("inf"), "has infinities in different places"
    err = float(np.max(np.abs(got64[finite] - ref64[finite]), initial=0.0))
    scale = float(np.max(np.abs(ref64[finite & ~np.isin(ref64, masks_of(ref).values)]), initial=0.0))
    if err > atol + rtol * scale:
        return False, err, f"max abs error {err:.3g} > {atol:g} + {rtol:g} * {scale:.3g}"
    return True, err, ""


def _max_abs_err(r: np.ndarray, g: np.ndarray) -> float:
    if r.size == 0:
        return 0.0
    if not (np.isfinite(g).all() and np.isfinite(r).all()):
        return float("inf")
    return float(np.max(np.abs(r - g)))


def _rel_err(r: np.ndarray, g: np.ndarray) -> float:
    if not (np.isfinite(g).all() and np.isfinite(r).all()):
        return float("inf")
    return float(np.linalg.norm(r - g) / (np.linalg.norm(r) + 1e-12))


def _cosine(r: np.ndarray, g: np.ndarray) -> float:
    if not (np.isfinite(g).all() and np.isfinite(r).all()):
        return float("nan")
    r1, g1 = r.ravel(), g.ravel()
    denom = np.linalg.norm(r1) * np.linalg.norm(g1)
    if denom == 0:
        return 1.0 if not r1.any() and not g1.any() else float("nan")
    return float(r1 @ g1 / denom)


def sample_cosines(ref: np.ndarray, got: np.ndarray, shared: np.ndarray | None = None) -> np.ndarray | None:
    """Each sample's cosine: its row of the batch axis, flattened, against the reference's. One sample wrong out of
    a batch hardly moves the cosine of the whole output (its share of the norm is one in N), so gates read the worst
    of these. A sample's own cosine is unstable where its reference norm is small (a blank image's map, a padded
    row, logits near zero): an engine's ordinary error, of the same size on every sample, turns it by a large
    angle. So each sample counts the higher of its own cosine and the cosine its error would give at right angles
    to a sample of the median norm, 1 - |got - ref|^2 / (2 median^2): a small sample passes when its error is one a
    typical sample may have, a sample of median norm or more is in effect held to its own cosine (the error that
    turns it by an angle gives no higher value at the median norm), and a sample fails only when both its direction
    and its error are off. None: under two values per sample (the cosine of one number is its sign), or a reference
    of zeros only. NaN: a sample with a value that is not finite in one of the two (the values both hold alike are
    equal, as for ``cosine``: :func:`set_aside`, or ``shared`` where the caller has it)."""
    if ref.ndim < 2 or not len(ref) or ref[0].size < 2:
        return None
    r, g = (np.asarray(a, dtype=np.float64).reshape(len(a), -1) for a in (ref, got))
    shared = (set_aside(r, g) if shared is None else shared).reshape(r.shape)
    finite = np.ones(len(r), dtype=bool)
    if shared.any() or not (np.isfinite(r).all() and np.isfinite(g).all()):
        r, g, finite = _rows_beside(r, g, shared)
    rr, gg, rg = (np.einsum("ij,ij->i", a, b) for a, b in ((r, r), (g, g), (r, g)))  # no copy of the rows
    norm, got_norm = np.sqrt(rr), np.sqrt(gg)
    if not (norm[finite] > 0).any():
        return None
    median = float(np.median(norm[finite & (norm > 0)]))
    with np.errstate(invalid="ignore", divide="ignore"):  # a row of zeros has no direction: cosine 0
        own = np.where((norm > 0) & (got_norm > 0), rg / (norm * got_norm), 0.0)
    by_error = 1.0 - np.maximum(rr - 2.0 * rg + gg, 0.0) / (2.0 * median**2)
    cos = np.clip(np.maximum(own, by_error), -1.0, 1.0)
    return np.where(finite, cos, np.nan)


def _rows_beside(r: np.ndarray, g: np.ndarray, shared: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows ``r`` and ``g`` with the values both hold alike (``shared``: :func:`set_aside`) set to 0, so they
    count as equal; and which rows are finite then. A row with a value not finite in one of them only is zeroed
    whole, and is not finite."""
    r, g = np.where(shared, 0.0, r), np.where(shared, 0.0, g)
    finite = np.isfinite(r).all(1) & np.isfinite(g).all(1)
    return np.where(finite[:, None], r, 0.0), np.where(finite[:, None], g, 0.0), finite


def worst_sample(ref: np.ndarray, got: np.ndarray, batch_axis: int = 0) -> tuple[float | None, int | None]:
    """The worst sample's cosine and its index (:func:`sample_cosines`) where the samples lie along ``batch_axis``
    (a time-major output's ``[T, N, ...]``: axis 1), not axis 0 as :func:`compare_arrays` takes them."""
    r, g = (np.moveaxis(np.asarray(a, dtype=np.float64), batch_axis, 0) for a in (ref, got))
    return _worst_sample(sample_cosines(r, g))


def _worst_sample(cos: np.ndarray | None) -> tuple[float | None, int | None]:
    """The lowest per-sample cosine and its row (a NaN first: it is the worst)."""
    if cos is None:
        return None, None
    nan = np.flatnonzero(np.isnan(cos))
    row = int(nan[0]) if len(nan) else int(np.argmin(cos))
    return float(cos[row]), row


def class_axis(ndim: int) -> int:
    """The class axis of a logits output: the last ([N, C], a language model's [N, S, V]), or 1 from four axes on
    ([N, C, H, W]: segmentation class maps, as torch's cross_entropy takes them)."""
    return 1 if ndim >= 4 else -1


def _top1(
    r: np.ndarray,
    g: np.ndarray,
    rel_tie: float,
    where: np.ndarray | None = None,
    shared: np.ndarray | None = None,
    binary_at: float | None = None,
) -> tuple[float | None, float | None]:
    """(top-1 agreement, the fraction of rows that flipped on a tie). A flip is a tie where the reference's margin
    between its class and the candidate's lies within ``rel_tie`` of its largest magnitude, or within the
    candidate's own error on that row: :data:`TIE_SIGMAS` robust deviations of its error on the row's other
    classes (so the flip's own error does not excuse it), where that error is small (:data:`TIE_MAX_NOISE` of the
    row's spread). Rows with fewer than :data:`TIE_MIN_CLASSES` classes have no such measure. The magnitude, the
    errors and the spread are those of the values not ``shared`` (:func:`set_aside`: a mask's -1e9 would make every
    flip a tie). A class axis of one entry with ``binary_at`` given is one logit z, the two classes' logits
    [``binary_at``, z] (:func:`_two_classes`): its decision, z above ``binary_at``, flips on a tie where the
    reference's z lies within ``rel_tie`` of the largest distance of its values from ``binary_at``; one logit per
    row without a class axis (``[N]``) is that logit too."""
    rows = _agreeing(r, g, rel_tie, where, shared, binary_at)
    if rows is None:
        return None, None
    _, agree, tied = rows
    if not len(agree):
        return 1.0, 0.0
    return float(np.mean(agree)), float(np.mean(tied))


def _agreeing(
    r: np.ndarray,
    g: np.ndarray,
    rel_tie: float,
    where: np.ndarray | None = None,
    shared: np.ndarray | None = None,
    binary_at: float | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Per row (or position) that :func:`_top1` counts: the reference's class, whether the candidate agrees (a flip
    on a tie agreeing), and whether it flipped on a tie; None where there is no class axis to agree on."""
    if binary_at is not None and r.ndim == 1:  # [N]: one logit per row, as [N, 1]
        r, g = r[:, None], g[:, None]
        shared = None if shared is None else shared[:, None]
    axis = class_axis(r.ndim)
    if binary_at is not None and r.ndim >= 2 and r.shape[axis] == 1:
        r, g, shared = _two_classes(r, g, shared, axis, binary_at)
    if r.ndim < 2 or r.shape[axis] < 2:
        return None
    shared = np.zeros(r.shape, dtype=bool) if shared is None else shared
    r2, g2, s2 = (np.moveaxis(a, axis, -1).reshape(-1, r.shape[axis]) for a in (r, g, shared))
    if where is not None and where.size == len(r2):
        r2, g2, s2 = r2[where.reshape(-1)], g2[where.reshape(-1)], s2[where.reshape(-1)]
    if not len(r2):
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool), np.zeros(0, dtype=bool)
    ri, gi = r2.argmax(-1), g2.argmax(-1)
    rows = np.arange(len(r2))
    margin = np.abs(r2[rows, ri] - r2[rows, gi])
    values = np.where(s2, np.nan, r2)  # the values compared: beside the masks
    with warnings.catch_warnings():  # a row of masks or non-finite errors has nothing to measure: NaN, no tie
        warnings.simplefilter("ignore", RuntimeWarning)
        tie = margin <= rel_tie * max(float(np.nanmax(np.abs(values), initial=0.0)), 1e-30)
        if r2.shape[1] >= TIE_MIN_CLASSES:
            err = np.abs(g2 - r2)
            err[s2] = np.nan
            err[rows, ri] = err[rows, gi] = np.nan  # the two classes of a flip: their error is the flip itself
            noise = 1.4826 * np.nanmedian(err, axis=1)
            tie |= (margin <= TIE_SIGMAS * noise) & (noise <= TIE_MAX_NOISE * np.nanstd(values, axis=1))
    flips = ri != gi
    return ri, ~flips | tie, flips & tie


@dataclass(frozen=True)
class ClassAgreement:
    """Dense class logits one class dominates (:func:`class_agreement`): that class's share of the positions, and
    the class the reference predicts whose positions the candidate agrees with least, with that agreement."""

    top_class_share: float
    worst_class: int
    worst_class_agreement: float


# A class the reference predicts at fewer positions than this has no agreement of its own to report: a few
# positions' flips would be noise
CLASS_MIN_POSITIONS = 100


def class_agreement(
    ref: np.ndarray, got: np.ndarray, where: np.ndarray | None = None, rel_tie: float = 0.0
) -> ClassAgreement | None:
    """Of dense class logits (positions besides the batch: ``[N, A, C]``, ``[N, C, D, H, W]``) whose reference says
    one class at more than :data:`DOMINANT_CLASS` of the positions, the agreement per class the reference predicts
    (at :data:`CLASS_MIN_POSITIONS` positions or more): the share of its positions where the candidate says it
    too, a flip on a tie agreeing (:func:`_top1`). Their overall agreement is the dominant class's (a volume's
    background), and an engine that shrinks every rare region barely moves it. Over the positions ``where`` says
    (labelled ones), else every position: a rare class's uncertain boundary is where a biased engine flips it.
    None: logits per row, fewer than two classes, no class dominating, or no class of enough positions."""
    axis = class_axis(np.ndim(ref))
    if np.ndim(ref) < 3 or np.asarray(ref).dtype.kind != "f" or ref.shape[axis] < 2:
        return None
    if not _dominated(np.asarray(ref), axis, where):  # the reference's argmax alone: no ties' noise measured
        return None
    r, g = np.asarray(ref, dtype=np.float64), np.asarray(got, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        rows = _agreeing(r, g, rel_tie, where, set_aside(r, g))
    if rows is None or not len(rows[0]):
        return None
    classes, agree = rows[0], rows[1]
    counts = np.bincount(classes, minlength=ref.shape[axis])
    share = float(counts.max() / len(classes))
    if share <= DOMINANT_CLASS:
        return None
    recall = {int(c): float(np.mean(agree[classes == c])) for c in np.flatnonzero(counts >= CLASS_MIN_POSITIONS)}
    if not recall:
        return None
    worst_class = min(recall, key=lambda c: recall[c])
    return ClassAgreement(share, worst_class, recall[worst_class])


def _dominated(ref: np.ndarray, axis: int, where: np.ndarray | None) -> bool:
    """Whether one class is the reference's top class at more than :data:`DOMINANT_CLASS` of the positions counted:
    checked before :func:`class_agreement` measures each class's agreement, whose tie noise (a median over every
    class of every position) a language model's logits would pay at every comparison for nothing."""
    top = np.moveaxis(ref, axis, -1).reshape(-1, ref.shape[axis]).argmax(-1)
    if where is not None and where.size == len(top):
        top = top[where.reshape(-1)]
    return bool(len(top)) and np.bincount(top).max() / len(top) > DOMINANT_CLASS


def _two_classes(
    r: np.ndarray, g: np.ndarray, shared: np.ndarray | None, axis: int, at: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """One logit per row (a class axis of one entry) as the two classes' logits, measured from the decision
    threshold ``at``: [0, z - at]. The argmax is then the decision (class 1 where z lies above ``at``; a tie at
    ``at`` itself is class 0, as ``z > at`` says), and the margin between the classes is the distance from ``at``."""
    r, g = (np.concatenate([np.zeros_like(a), a - at], axis) for a in (r, g))
    if shared is not None:
        shared = np.concatenate([np.zeros_like(shared), shared], axis)
    return r, g, shared


def value_ordered(
    ref: dict[str, np.ndarray], got: dict[str, np.ndarray], names: list[str]
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """``ref`` and ``got`` with the rows of the outputs ``names`` (whose length the values decide: a detector's
    boxes ``[K, 4]``, scores and labels ``[K]`` after NMS) in one order of their values, the same permutation for
    the outputs of one length, where that agrees better than the order they came in: runtimes order equal scores
    apart (ONNX Runtime's TopK against torch.topk), and the same detections in another order are no error, while
    reduced precision's noise on close boxes would reorder rows that agree as they came. Rows of records only (one
    or two axes): an output of more (an RNN's time-major ``[T, B, H]``) keeps its order, which is its answer.
    Outputs whose lengths differ are left for the comparison to name."""
    groups: dict[int, list[str]] = {}
    for n in names:
        if n in ref and n in got and 1 <= ref[n].ndim <= 2 and ref[n].shape == got[n].shape and len(ref[n]) > 1:
            groups.setdefault(len(ref[n]), []).append(n)
    ref, got = dict(ref), dict(got)
    for members in groups.values():
        scales = {n: float(np.abs(ref[n]).max(initial=0.0)) or 1.0 for n in members}
        r_perm, g_perm = _value_order(ref, members, scales), _value_order(got, members, scales)
        as_came = max(_max_abs_err(ref[n], got[n]) for n in members)
        ordered = max(_max_abs_err(ref[n][r_perm], got[n][g_perm]) for n in members)
        if ordered < as_came:
            ref.update({n: ref[n][r_perm] for n in members})
            got.update({n: got[n][g_perm] for n in members})
    return ref, got


def _value_order(outs: dict[str, np.ndarray], members: list[str], scales: dict[str, float]) -> np.ndarray:
    """The permutation sorting the rows of ``members`` by their values, rounded to 1e-4 of each output's largest
    (the first column first)."""
    cols = [np.round(outs[n].reshape(len(outs[n]), -1).astype(np.float64) / scales[n], 4) for n in members]
    return np.lexsort(np.concatenate(cols, axis=1).T[::-1])
