"""One check for precision and validation: the held-out data at every validated shape, the reference's outputs on
it, the comparison of a candidate (an engine, or a precision variant's graph) against them, and the gates.

The precision stage accepts a variant through exactly this code, with the gates validation will apply to its
engines, so a run never ends with validation rejecting a variant the precision stage accepted.
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from kiln.core.compare import (
    AGREEMENT_NAMES,
    Masks,
    OutputStats,
    agrees,
    class_agreement,
    class_axis,
    compare_outputs,
    integer_levels,
    masks_of,
    set_aside,
    systematic_of,
    value_ordered,
    worst,
)
from kiln.core.data import DatasetSplits, Feed, feed_for_graph, feed_rows, feed_take, rows, take
from kiln.core.errors import ConfigError, ModelError
from kiln.core.labels import (
    IGNORE_LABEL,
    floating,
    follows_output,
    follows_positions,
    is_mask_name,
    left_padded,
    padding_ties,
    per_position,
    without_padding,
)
from kiln.core.labels import accuracy as label_accuracy
from kiln.core.output_names import detection_labels, logits_name, one_hot, refuse_unknown_gated
from kiln.core.records import EngineValidation
from kiln.core.shapes import Axes, axis_sizes, length_inputs, resize, shape_points
from kiln.stages.accuracy.config import CheckConfig, GatesConfig
from kiln.stages.accuracy.config import derived_rel_err as rel_err_of_cosine
from kiln.stages.accuracy.metrics import (
    BOX_FORMAT,
    Metric,
    against_reference,
    decided_by,
    decision_threshold,
    default_metric,
    metric_labels,
    resolve_metric,
    scaled_by,
)

log = logging.getLogger("kiln.validate")
LATENCY_GATE = "p50 latency"  # how the one gate that is not about accuracy starts


REBUILD = "rebuild the engines from this model's ONNX export (kiln run --force export)"


def compare_all(
    ref: dict[str, np.ndarray],
    got: dict[str, np.ndarray],
    logits: str | None,
    where: np.ndarray | None = None,
    mismatch_hint: str = REBUILD,
    spread: dict[str, float] | None = None,
    decisions: bool = False,
    per_row: bool = True,
    levels: Collection[str] | None = None,
    whole: Collection[str] = (),
) -> dict[str, OutputStats]:
    """Every output of the reference against the candidate's output of the same name (each side's outputs the
    other's too: an output served and never compared is refused, as one missing is); top-1 agreement only on
    the class-logit output (on a hidden state it would be noise), and with per-position labels only over the
    labelled positions (``where``: a token classifier's padding carries no label and no answer anyone reads);
    without them, over a dense head's positions only those the reference is confident at, and never a padded one
    (:func:`counted_positions`). Each float output's relative error is relative to how the reference varies
    between samples (``spread``: :func:`spreads`, the whole held-out set's where this is a few rows of it; else
    this reference's own): :func:`relative_to_spread`. Class logits of one entry on their class axis are a binary
    classifier's logit (:func:`binary_logit`), whose top-1 agreement is that of its decision: above the threshold
    :func:`~kiln.stages.accuracy.metrics.decision_threshold` reads off the reference (0 for a logit). With
    ``decisions`` (a multi-label head's logits: :func:`multi_hot`) each label is such a decision, and the agreement
    is over every (sample, label) pair (:func:`as_decisions`), marked so (``agreement="decision"``: reports and
    failures name it decision agreement, not top-1). Class logits of one value per row (``[N]``, no class axis) are
    such a logit too where ``per_row`` (the :class:`Reference`'s :attr:`~Reference.binary_at` says; by default
    they are, as where the user names them with no data to say otherwise). ``levels``: the integer outputs held to
    their error as float outputs are (:func:`level_outputs`, of the whole held-out set where this is a few rows of
    it; None: of this reference). ``whole``: the outputs without a batch axis (a 0-D loss, stacked one value a call:
    :attr:`Reference.scalars`), which have no samples to vary between: no cosine, and their relative error over
    their norm (:func:`~kiln.core.compare.compare_arrays`; a 0-D output is one by its shape).
    ``mismatch_hint``: the fix when the outputs are not the reference's (names or shapes)."""
    missing = sorted(set(ref) - set(got))
    if missing:
        raise ModelError(
            f"the engine has no output {missing} (it has {sorted(got)})",
            hint=mismatch_hint,
        )
    unchecked = sorted(set(got) - set(ref))
    if unchecked:  # an output the engine serves that nothing would compare: refused as the reverse is
        raise ModelError(
            f"the reference has no output {unchecked} that the engine serves (the reference has {sorted(ref)})",
            hint=f"give a reference with every output the engine has: {mismatch_hint}",
        )
    counted = [n for n in ref if n in got and _only_rows_differ(ref[n], got[n])]
    if counted:  # a count the values decide (torch.nonzero, NMS) came out otherwise: the answers differ
        n = counted[0]
        raise ModelError(
            f"the engine's output '{n}' has {len(got[n])} rows where the reference's has {len(ref[n])}: its length "
            "follows the values (a threshold, torch.nonzero, NMS), and the engine's values crossed it otherwise",
            hint="keep the nodes before that threshold in float (calibration.exclude_nodes, precision.fp16."
            "fp32_ops), or serve the scores and threshold them outside the engine",
        )
    decide = decisions and logits is not None and logits in ref
    labelled = where
    if where is None and logits is not None and logits in ref and not decide:
        where = counted_positions(ref[logits])
    rows = len(ref[logits]) if per_row and logits in ref and ref[logits].ndim else None
    one = logits in ref and (decide or binary_logit(ref[logits], rows))
    binary = {logits: decision_threshold(ref[logits])} if one else None
    try:
        masks = {logits: where} if logits is not None and where is not None else None
        compared = as_decisions(ref, got, logits) if decide else (ref, got)
        held = level_outputs(ref, logits) if levels is None else levels
        stats = compare_outputs(*compared, where=masks, binary_at=binary, levels=held, whole=whole)
    except ValueError as exc:  # an output of another shape than the reference's at the same inputs
        raise ModelError(
            f"the engine's outputs do not match the reference's: {exc}",
            hint=mismatch_hint,
        ) from None
    stats = relative_to_spread(stats, ref, got, spreads(ref, held) if spread is None else spread, logits)
    if decide:
        stats[logits] = replace(stats[logits], agreement="decision")
    elif one:  # its value is the answer's probability: noted, so that rel_err_limits holds it
        stats[logits] = KeptStats(**{**vars(stats[logits]), "decision_at": binary[logits]})
    elif not one and logits in stats and stats[logits].top1_agreement is not None:
        counted = labelled if labelled is not None else decided_positions(ref[logits])
        stats[logits] = with_class_agreement(stats[logits], ref[logits], got[logits], counted)
    # an integer output keeps its agreement (its share of equal values: compare_arrays) in place of a cosine
    keep = {n for n, s in stats.items() if n == logits or s.cosine is None}
    return {n: s if n in keep else replace(s, top1_agreement=None, top1_ties=None) for n, s in stats.items()}


def with_class_agreement(stats: OutputStats, ref: np.ndarray, got: np.ndarray, where: np.ndarray | None) -> OutputStats:
    """``stats`` of dense class logits with the worst class's agreement where one class dominates them
    (:func:`~kiln.core.compare.class_agreement`, over the labelled positions ``where``, else every position)."""
    found = class_agreement(ref, got, where)
    if found is None:
        return stats
    return replace(
        stats,
        top_class_share=found.top_class_share,
        worst_class=found.worst_class,
        worst_class_agreement=found.worst_class_agreement,
    )


def level_outputs(ref: dict[str, np.ndarray], logits: str | None) -> set[str]:
    """The integer outputs that hold levels of a quantity (:func:`~kiln.core.compare.integer_levels`: uint8 pixel
    values, a count), held to how far they are off as float outputs are: one level off is a small error there. Not
    the class ``logits`` themselves, nor the class ids of them, an output whose values all lie within their class
    axis (an argmax of them): those are answers, compared value for value."""
    classes = _class_count(ref.get(logits or ""))
    out = set()
    for name, value in ref.items():
        if name == logits or integer_levels(value) is None:
            continue
        if classes and value.min() >= 0 and value.max() < classes:
            continue
        out.add(name)
    return out


def _class_count(logits: np.ndarray | None) -> int:
    """The width of the class axis of float class ``logits`` (0: none, or no class axis)."""
    if logits is None or logits.dtype.kind != "f" or logits.ndim < 2:
        return 0
    return int(logits.shape[class_axis(logits.ndim)])


def as_decisions(
    ref: dict[str, np.ndarray], got: dict[str, np.ndarray], logits: str
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """``ref`` and ``got`` with a multi-label head's ``logits`` ``[N, K, ...]`` as ``[N, K..., 1]``: each label a
    binary classifier's one logit, whose top-1 agreement (:func:`~kiln.core.compare.compare_arrays`' ``binary_at``)
    is its decision's, counted over every (sample, label) pair. Each sample's values stay its row: its cosine and
    errors are the same."""
    r, g = ref[logits], got[logits]
    return {**ref, logits: r.reshape(len(r), -1, 1)}, {**got, logits: g.reshape(len(g), -1, 1)}


# The reference's top class the same at this many rows or positions (or more) is warned of: below it, one class on
# top may be the held-out rows' own
MIN_ONE_CLASS = 16
# A position of a dense head is a decision the reference makes where its top class has at least this probability
CONFIDENT = 0.5
# An output (nearly) constant over the samples has no spread to measure an error by, only noise: at least this share
# of its RMS. Low, since an output on a level far above its spread (a forecast of a series around 300 that moves by
# 1) is measured by that spread; an error 1000x what the norm-relative one would be is the most this measure adds.
SPREAD_FLOOR = 1e-2


def confident_positions(logits: np.ndarray) -> np.ndarray | None:
    """Of class logits with positions (``[N, A, C]`` a detector's anchors, ``[N, C, H, W]`` a segmentation's
    pixels), those where the reference's top class has a probability of :data:`CONFIDENT` or more (softmax over
    the class axis, :func:`class_axis`; the values themselves where every one lies within [0, 1]), shaped like
    the logits without their class axis. Only those are decisions anyone reads: a dense head answers at every
    anchor, most of them background whose class scores all lie low and close, and an engine's small error flips
    their argmax at random while every detection stays the same. None (count every position): logits per row
    (``[N, C]``: each row is a sample's answer), fewer than two classes, or no position confident at all (a model
    with random weights)."""
    axis = class_axis(logits.ndim)
    if logits.ndim < 3 or logits.dtype.kind != "f" or logits.shape[axis] < 2:
        return None
    r = np.moveaxis(np.asarray(logits, dtype=np.float64), axis, -1)
    finite = r[np.isfinite(r)]
    if finite.size and finite.min() >= 0.0 and finite.max() <= 1.0:
        top = r.max(-1)
    else:
        with np.errstate(invalid="ignore", over="ignore"):
            top = 1.0 / np.exp(r - r.max(-1, keepdims=True)).sum(-1)  # the softmax of the largest logit
    sure = top >= CONFIDENT
    return sure if sure.any() else None


def decided_positions(logits: np.ndarray) -> np.ndarray | None:
    """Of class logits with positions (as :func:`confident_positions` reads them), those where the reference's
    values are not one value across the class axis; None where every position is (or the logits have no positions).
    A position of equal values makes no decision: padding that :func:`kiln.core.labels.without_padding` zeroed in
    both the reference and the candidate, which would otherwise count as agreeing at every padded position."""
    axis = class_axis(logits.ndim)
    if logits.ndim < 3 or logits.dtype.kind != "f" or logits.shape[axis] < 2:
        return None
    r = np.moveaxis(np.asarray(logits), axis, -1)
    with np.errstate(invalid="ignore"):
        decided = ~(r == r[..., :1]).all(-1)
    return None if decided.all() else decided


def counted_positions(logits: np.ndarray) -> np.ndarray | None:
    """The positions top-1 agreement counts without labels: those the reference is confident at
    (:func:`confident_positions`) and decides at, else every position it decides (:func:`decided_positions`): never
    one whose values are all equal (two classes' zeroed padding has a softmax of 0.5, as confident as
    :data:`CONFIDENT`). None: every position."""
    decided, sure = decided_positions(logits), confident_positions(logits)
    if sure is None or decided is None:
        return decided if sure is None else sure
    both = sure & decided
    return both if both.any() else decided


def spreads(ref: dict[str, np.ndarray], levels: Collection[str] = ()) -> dict[str, float]:
    """Per float output (and integer one of ``levels``: :func:`level_outputs`) of at least two rows: the RMS of the
    reference's deviation from its mean over the rows (the samples), at least :data:`SPREAD_FLOOR` of its own RMS:
    how much the output varies with its input. What every input shares (a detector's anchor grid under its pixel
    boxes, an offset) is no information the engine must keep, and would hide an error measured against the output's
    whole norm. Over the values compared only: a mask's -inf or -1e9 (:func:`~kiln.core.compare.set_aside`) is
    neither a spread nor a level."""
    out: dict[str, float] = {}
    for name, value in ref.items():
        r = np.asarray(value)
        if (r.dtype.kind != "f" and name not in levels) or r.ndim < 1 or len(r) < 2:
            continue
        spread = _spread(r.astype(np.float64), set_aside(r, r))
        if spread is not None:
            out[name] = spread
    return out


def _spread(r: np.ndarray, masked: np.ndarray, floor: float = SPREAD_FLOOR) -> float | None:
    """:func:`spreads` of one output, beside its ``masked`` values (each position's mean over the rows that hold a
    value there), at least ``floor`` of its RMS; None where nothing is left or all of it is 0."""
    values = np.where(masked, np.nan, r)
    if np.isnan(values).all():
        return None
    with warnings.catch_warnings():  # a position masked in every row has no mean: it adds nothing
        warnings.simplefilter("ignore", RuntimeWarning)
        dev = float(np.sqrt(np.nanmean((values - np.nanmean(values, axis=0)) ** 2)))
    rms = float(np.sqrt(np.nanmean(values**2)))
    return max(dev, floor * rms) if rms > 0 else None


def relative_to_spread(
    stats: dict[str, OutputStats],
    ref: dict[str, np.ndarray],
    got: dict[str, np.ndarray],
    spread: dict[str, float],
    logits: str | None = None,
) -> dict[str, OutputStats]:
    """Each float output's relative error as the RMS of its error over its ``spread`` (:func:`spreads`) in place
    of over its own RMS: a 30 % shrink of pixel boxes is 4 % of their norm, most of which is the anchor grid, and
    over 100 % of how they vary between images. The values both hold alike (a mask's, :func:`set_aside`) are left
    out, as :func:`~kiln.core.compare.compare_arrays` leaves them. An infinite error (a value not finite in one of
    the two) stays, as does the error of an output with no spread measured (one row; nothing but masks). The class
    ``logits`` keep the error over their norm: what it holds is their scale (the softmax's confidence), which an
    offset every class shares does not change, and logits that barely vary between samples (a model little
    trained) would otherwise make FP16's rounding a large error. The error's systematic part
    (:func:`~kiln.core.compare.systematic`) is over what the error is over."""
    out = dict(stats)
    for name, s in stats.items():
        if s.cosine is None or name not in spread or name == logits or not np.isfinite(s.rel_err):
            continue
        r, g = np.asarray(ref[name], dtype=np.float64), np.asarray(got[name], dtype=np.float64)
        kept = ~set_aside(ref[name], got[name])
        err = float(np.sqrt(np.mean((g[kept] - r[kept]) ** 2))) if kept.any() else 0.0
        line = systematic_of(r, g, spread[name], kept)  # its systematic part over the same spread
        out[name] = replace(s, rel_err=err / spread[name], norm_rel_err=s.rel_err, **line)
    return out


@dataclass(frozen=True)
class KeptStats(OutputStats):
    """An output's statistics with what the check notes of it beside them. ``over_variation``: where its spread is
    :data:`SPREAD_FLOOR` (the output varies between samples by less), its RMS error over how it does vary. Above 1
    the engine's error is larger than anything the output tells apart between samples, however small beside its
    level, and no message may call it a small error to accept (:func:`_over_spread`). ``decision_at``: the class
    logits are a binary classifier's one logit, deciding above this value (:func:`compare_all`); its value is the
    probability the model answers, which :func:`rel_err_limits` holds as any other value. ``engine_nonfinite_rows``
    and ``engine_nonfinite_first``: how many held-out rows the engine answers NaN/inf at where the reference is
    finite, and the first of them; ``reference_nonfinite_*`` the reverse (:func:`with_nonfinite`): a cosine of NaN
    then says which side holds no number, and where."""

    over_variation: float | None = None
    decision_at: float | None = None
    engine_nonfinite_rows: int | None = None
    engine_nonfinite_first: int | None = None
    reference_nonfinite_rows: int | None = None
    reference_nonfinite_first: int | None = None

    def as_dict(self) -> dict[str, float | None]:
        """The statistics by name, each note only where set (records of other outputs keep theirs)."""
        stats = super().as_dict()
        for note in NOTES:
            if stats[note] is None:
                del stats[note]
        return stats


NONFINITE = ("engine_nonfinite_rows", "engine_nonfinite_first", "reference_nonfinite_rows", "reference_nonfinite_first")
NOTES = ("over_variation", "decision_at", *NONFINITE)  # the fields KeptStats adds to OutputStats
LOWEST = ("decision_at", "engine_nonfinite_first", "reference_nonfinite_first")  # merged as their lower value


def with_nonfinite(
    stats: dict[str, OutputStats], ref: dict[str, np.ndarray], got: dict[str, np.ndarray]
) -> dict[str, OutputStats]:
    """``stats`` with, per float output, the held-out rows one side answers NaN/inf at where the other is finite
    (:data:`NONFINITE`): its cosine is then undefined, and the failure must say which side to look at."""
    out = dict(stats)
    for name, s in stats.items():
        sides = one_sided_nonfinite(np.asarray(ref.get(name, ())), np.asarray(got.get(name, ())))
        if sides:
            out[name] = KeptStats(**{**vars(s), **sides})
    return out


def one_sided_nonfinite(ref: np.ndarray, got: np.ndarray) -> dict[str, int]:
    """The rows (of the batch axis) ``got`` holds NaN/inf in where ``ref`` is finite, and the reverse, each as a count
    and its first row (:data:`NONFINITE`); empty where neither side has such a row or the arrays are no float rows."""
    if ref.dtype.kind != "f" or got.dtype.kind != "f" or ref.shape != got.shape or ref.ndim < 1 or not ref.size:
        return {}
    finite_ref, finite_got = ~nonfinite_rows(ref), ~nonfinite_rows(got)
    notes = {}
    for side, at in (
        ("engine", np.flatnonzero(finite_ref & ~finite_got)),
        ("reference", np.flatnonzero(finite_got & ~finite_ref)),
    ):
        if at.size:
            notes[f"{side}_nonfinite_rows"], notes[f"{side}_nonfinite_first"] = int(at.size), int(at[0])
    return notes


def nonfinite_rows(a: np.ndarray) -> np.ndarray:
    """Per row of ``a``'s first axis, whether it holds a NaN or an infinity."""
    return ~np.isfinite(a).reshape(len(a), -1).all(axis=1)


def nonfinite_said(stats: dict[str, Any]) -> str:
    """Which side of a comparison answers NaN/inf where the other is finite, at how many rows and first where
    (:func:`with_nonfinite`); empty where neither is noted."""
    said = []
    for side, other in (("engine", "reference"), ("reference", "engine")):
        rows = stats.get(f"{side}_nonfinite_rows")
        if rows:
            first = stats.get(f"{side}_nonfinite_first")
            said.append(
                f"the {side} answers NaN/inf at {rows} row{'' if rows == 1 else 's'} (first: {first}) where the "
                f"{other} is finite"
            )
    return "; ".join(said)


def with_variation(
    stats: dict[str, OutputStats], ref: dict[str, np.ndarray], spread: dict[str, float]
) -> dict[str, OutputStats]:
    """``stats`` with each output's :attr:`KeptStats.over_variation` where its ``spread`` is the floor and the
    reference (every held-out row) still varies between its samples: measured here, since the floor hides it."""
    out = dict(stats)
    for name, s in stats.items():
        r = np.asarray(ref.get(name, ()))
        if name not in spread or s.cosine is None or s.norm_rel_err is None or r.ndim < 1 or len(r) < 2:
            continue
        if not s.rel_err > SMALL_SPREAD * s.norm_rel_err:  # a spread near the norm: not floored, and not said
            continue
        dev = _spread(r.astype(np.float64), set_aside(r, r), floor=0.0)
        if dev and dev < spread[name] and np.isfinite(s.rel_err):
            out[name] = KeptStats(**{**vars(s), "over_variation": s.rel_err * spread[name] / dev})
    return out


def _only_rows_differ(ref: np.ndarray, got: np.ndarray) -> bool:
    return ref.ndim == got.ndim >= 1 and ref.shape[1:] == got.shape[1:] and len(ref) != len(got)


def merge_worst(a: dict[str, OutputStats], b: dict[str, OutputStats]) -> dict[str, OutputStats]:
    """Per output, the worse value of each statistic (NaN is worst)."""

    def pick(x: float | None, y: float | None, higher: bool) -> float | None:
        if x is None or y is None:
            return y if x is None else x
        if np.isnan(x) or np.isnan(y):
            return float("nan")
        return min(x, y) if higher else max(x, y)

    out = dict(a)
    for name, s in b.items():
        if name in out:
            t = out[name]
            s = OutputStats(
                pick(t.max_abs_err, s.max_abs_err, False),
                pick(t.rel_err, s.rel_err, False),
                pick(t.cosine, s.cosine, True),
                pick(t.top1_agreement, s.top1_agreement, True),
                pick(t.top1_ties, s.top1_ties, False),
                *_worse_sample(t, s),
                pick(t.norm_rel_err, s.norm_rel_err, False),
                _most(t.levels, s.levels),
                *_worse_class(t, s),
                "decision" if "decision" in (t.agreement, s.agreement) else "top1",
                *_worse_line(t, s),
            )
            notes = {k: pick(getattr(t, k, None), getattr(b[name], k, None), k in LOWEST) for k in NOTES}
            if any(v is not None for v in notes.values()):
                s = KeptStats(**vars(s), **notes)
        out[name] = s
    return out


def _worse_class(a: OutputStats, b: OutputStats) -> tuple[float | None, int | None, float | None]:
    """The worse of two worst classes' agreements (:func:`with_class_agreement`), with its class and the share of
    the class that dominates where it was measured."""
    if a.worst_class_agreement is None or (
        b.worst_class_agreement is not None and b.worst_class_agreement < a.worst_class_agreement
    ):
        return b.top_class_share, b.worst_class, b.worst_class_agreement
    return a.top_class_share, a.worst_class, a.worst_class_agreement


def _worse_line(a: OutputStats, b: OutputStats) -> tuple[float | None, float | None, float | None]:
    """The larger of two systematic errors, with the slope and shift it was measured with (NaN is worst)."""
    x, y = a.systematic_err, b.systematic_err
    b_worse = x is None or (y is not None and (np.isnan(y) or (not np.isnan(x) and y > x)))
    return (b.systematic_err, b.slope, b.shift) if b_worse else (a.systematic_err, a.slope, a.shift)


def _most(a: int | None, b: int | None) -> int | None:
    """The larger of two counts of levels (the whole held-out set's, not a spot-check batch's); None where neither."""
    return None if a is None and b is None else max(a or 0, b or 0)


def _worse_sample(a: OutputStats, b: OutputStats) -> tuple[float | None, int | None]:
    """The worse of two worst samples (NaN is worst), with its row."""
    if a.sample_cosine is None or b.sample_cosine is None:
        return (b.sample_cosine, b.worst_sample) if a.sample_cosine is None else (a.sample_cosine, a.worst_sample)
    x, y = a.sample_cosine, b.sample_cosine
    b_worse = np.isnan(y) or (not np.isnan(x) and y < x)
    return (y, b.worst_sample) if b_worse else (x, a.worst_sample)


def summarize(
    entry: EngineValidation,
    stats: dict[str, OutputStats],
    logits: str | None,
    gated: list[str] | None = None,
    warn: bool = True,
) -> None:
    """The per-output statistics into the entry, every output's, and its headline values: those of the worst output
    the gates hold (``gated``: ``validate.gates.gated_outputs``; None: every output), so the headline says what the
    gates judged (the relative error the worst of them beside the class logits, where there are any); the class
    logits' top-1 agreement only where they are gated. An integer output has no cosine and is no class logits: its
    share of equal values stays in its own row (gated there), so a model of integer outputs only has no headline
    cosine or top-1 agreement, and its errors count in the headline only when no float output is gated.
    ``entry.agreement`` says what the class logits' agreement counts (:data:`~kiln.core.compare.Agreement`).
    ``warn``: say what the engine's figures hide (:func:`_warn_one_class`); off where the entry is no engine's (the
    precision stage's rounds judging a graph), so that validation says it once per engine, by its name."""
    entry.outputs = {n: s.as_dict() for n, s in stats.items()}
    held = {n: s for n, s in stats.items() if gated is None or n in gated} or stats
    floats = {n: s for n, s in held.items() if holds_floats(s.as_dict())}
    # an integer output's error is a difference of class indices or counts, no measure of closeness: where the
    # model has float outputs, the headline errors are theirs
    errors = floats or held
    # the class logits' relative error is gated (rel_err_limits) at FP32 and FP16 alone: the
    # headline, which reports show, is the other outputs' where there are any
    values = {n: v for n, v in errors.items() if n != logits} or errors
    entry.max_abs_err, entry.rel_err = worst(errors, "max_abs_err"), worst(values, "rel_err")
    cosines = {n: s for n, s in floats.items() if s.cosine is not None}  # none without a batch axis (a 0-D loss)
    entry.cosine = worst(cosines, "cosine") if cosines else None
    entry.top1_agreement = floats[logits].top1_agreement if logits in floats else None
    entry.top1_ties = floats[logits].top1_ties if logits in floats else None
    entry.agreement = stats[logits].agreement if logits in stats else "top1"
    if warn and logits in floats:
        _warn_one_class(entry, logits, floats[logits])
    if entry.gates:  # a limit derived from min_cosine is no setting: the record says it beside max_rel_err
        entry.gates = {**entry.gates, **held_rel_err(entry.outputs, entry.gates, entry.precision, gated)}


def _warn_one_class(entry: EngineValidation, logits: str, stats: OutputStats) -> None:
    """Warn where one class dominates dense class logits and a rarer class agrees below the top-1 gate the entry is
    held to (its gates' ``min_top1_agreement``, else the default for its precision) and below the whole's: the
    top-1 agreement gated is then the dominant class's (a volume's background), and a rare class's regions may
    shrink under it unseen. A class that agrees at the gate or above would pass that gate on its own: its
    shortfall beside the whole (0.9998 against 1.0: one flip in thousands) is within what the gate accepts of
    any answer, noise rather than a shrinking class, and not said."""
    share, worst_agreement = stats.top_class_share, stats.worst_class_agreement
    if share is None or worst_agreement is None or stats.top1_agreement is None:
        return
    limit = _top1_gate(entry)
    if not worst_agreement < stats.top1_agreement or worst_agreement >= limit - COUNT_SLACK:
        return
    log.warning(
        "engine %s: the top-1 agreement of '%s' (%.4f) is mostly one class's: the reference's top class is the same "
        "at %.1f%% of its positions, while class %d agrees at only %.4f of the positions the reference gives it, "
        "below min_top1_agreement %g. The top-1 gate does not see it; a per-class validate.metric over labels does "
        "(macro_f1, or a mean IoU)",
        entry.name,
        logits,
        stats.top1_agreement,
        100 * share,
        stats.worst_class,
        worst_agreement,
        limit,
    )


def _top1_gate(entry: EngineValidation) -> float:
    """The top-1 agreement ``entry`` is held to: its gates' (:func:`gates_for`), else the default for its
    precision."""
    held = entry.gates.get("min_top1_agreement")
    if isinstance(held, int | float):
        return float(held)
    return gates_for(GatesConfig(), entry.precision)["min_top1_agreement"]


def held_rel_err(
    per_output: dict[str, dict[str, Any]], gates: dict[str, Any], precision: str, gated: list[str] | None
) -> dict[str, Any]:
    """The relative-error limit ``gates`` hold an engine of ``precision`` to and the outputs held to it, of those
    ``gated`` (None: every output), as its gates record them (``rel_err_limit``, None where none is held;
    ``rel_err_outputs``): with ``max_rel_err`` unset the limit is derived (:func:`rel_err_limits`, one for every
    output it holds), and a record of ``max_rel_err: null`` alone would not say what the engine was held to."""
    limits = rel_err_limits(per_output, gates, precision)
    held = [n for n in limits if gated is None or n in gated]
    return {"rel_err_limit": limits[held[0]] if held else None, "rel_err_outputs": held}


def _refuse_batch_of_one(
    run: Callable[[Feed], dict[str, np.ndarray]], feed: Feed, batch: int, coupled: list[str]
) -> None:
    """Where the ``coupled`` outputs come with a first axis of one at ``batch`` rows: a model that takes one sample
    a call (a graph network given a graph as a batch of one), whose batch sizes must be [1]; said as that."""
    try:
        ones = [k for k, v in run(sample_batch(feed, batch)).items() if k in coupled and v.shape[:1] == (1,)]
    except Exception:  # the reference's own error surfaces where the comparisons run it
        return
    if ones:
        raise ModelError(
            f"the outputs {ones} have a first axis of 1 at a batch of {batch}: the model takes one sample a call "
            "(a batch of one), not a batch of them",
            hint="set signature.batch_sizes: [1] (its engines are then served unbatched)",
        )


def batch_coupled(
    run: Callable[[Feed], dict[str, np.ndarray]],
    feed: Feed,
    batch: int,
    smallest: int,
    big: dict[str, np.ndarray] | None = None,
) -> list[str]:
    """Outputs whose shape beyond the first axis follows the batch size (a contrastive model's ``[images, texts]``
    logits), or whose rows read their batch mates (:func:`mixed_rows`): their rows depend on the whole batch, so
    they compare only between calls on the same batch, and servers run them a request at a time. Probed at
    the largest validated batch against the smallest (or, with one size, the last, shorter batch of the held-out
    rows), sizes the model is validated at anyway; an output whose first axis is not the batch (a scalar) is one
    at the largest batch alone. A model that fails the probe is left to the comparisons to report. ``big``: the
    outputs at the largest batch where the caller has them (:func:`probe_batch`)."""
    big = probe_batch(run, feed, batch) if big is None else big
    if big is None:
        return []
    # on the first axis: an output whose rows are not the samples (a count the values decide, such as
    # torch.nonzero's or a detector's after NMS, or no batch axis at all)
    coupled = [k for k, v in big.items() if v.shape[:1] != (batch,)]
    other = smallest if smallest != batch else feed_rows(feed) % batch
    if other and feed_rows(feed) >= 2:
        try:
            small = run(sample_batch(feed, other))
        except Exception:
            small = {}
        # beyond the first axis (CLIP's [images, texts])
        coupled = [k for k in big if k in coupled or (k in small and big[k].shape[1:] != small[k].shape[1:])]
    return coupled + [k for k in mixed_rows(run, sample_batch(feed, batch), big) if k not in coupled]


def probe_batch(run: Callable[[Feed], dict[str, np.ndarray]], feed: Feed, batch: int) -> dict[str, np.ndarray] | None:
    """``run`` on ``batch`` rows of ``feed`` (:func:`sample_batch`); None where the model fails (its error surfaces
    where the comparisons run it)."""
    try:
        return run(sample_batch(feed, batch))
    except Exception:
        return None


def scalar_outputs(outputs: dict[str, np.ndarray] | None) -> list[str]:
    """The outputs of one call without a batch axis (0-D: a loss over the batch), which :func:`batched` stacks one
    value a call: no samples' rows, compared by their error over their norm (:func:`compare_all`'s ``whole``)."""
    return [k for k, v in (outputs or {}).items() if np.ndim(v) == 0]


def refuse_scalar_logits(logits: str | None, named: bool, scalars: Collection[str], outputs: Collection[str]) -> None:
    """A ConfigError where ``signature.logits_output`` (``named``) names an output without a batch axis (0-D): it
    holds one value a call, no class logits of each sample, and no top-1 agreement or accuracy could be measured
    on it; the fix lists the outputs with a batch axis."""
    if not named or logits is None or logits not in scalars:
        return
    rowed = [n for n in outputs if n not in scalars]
    raise ConfigError(
        f"signature.logits_output names '{logits}', a scalar without a batch axis: it cannot hold class logits",
        hint=f"name the output of class logits in signature.logits_output (those with a batch axis: {rowed})"
        if rowed
        else "unset signature.logits_output: no output has a batch axis to hold class logits",
    )


def class_axis_follows_batch(
    run: Callable[[Feed], dict[str, np.ndarray]],
    feed: Feed,
    outputs: dict[str, np.ndarray],
    name: str | None,
    batch: int,
    smallest: int,
) -> bool:
    """Whether output ``name``'s class axis (:func:`class_axis`) follows the batch: as long as the first batch of
    ``outputs`` (``run`` over ``feed`` in batches of ``batch`` rows) and, probed at ``smallest`` rows (or one row
    fewer, with one batch size), as long as that. A class axis of as many classes as the batch has rows keeps its
    size at the other. False where the model fails the probe (its error surfaces where the comparisons run it)."""
    out = outputs.get(name or "")
    first = min(batch, feed_rows(feed))
    if out is None or out.ndim < 2 or out.shape[class_axis(out.ndim)] != first:
        return False
    other = smallest if smallest < first else first - 1
    if other < 1:
        return False
    try:
        probed = run(sample_batch(feed, other)).get(name or "")
    except Exception:  # the reference's own error surfaces where the comparisons run it
        return False
    return probed is not None and np.ndim(probed) == out.ndim and probed.shape[class_axis(out.ndim)] == other


# The most rows of a probe batch :func:`mixed_rows` runs alone: each is one call of the reference at batch 1
MIXED_ROWS = 16


def mixed_rows(run: Callable[[Feed], dict[str, np.ndarray]], feed: Feed, got: dict[str, np.ndarray]) -> list[str]:
    """Outputs whose row differs when its sample runs alone from ``got`` (``run`` on the whole ``feed``), at any of
    the rows :func:`probed_rows` picks: rows that read their batch mates (a model whose axis 0 is time, not the
    batch; a normalization over the batch; a branch on a statistic of the whole batch, which only some rows take
    otherwise alone, so no one row tells). Beyond float noise between batch sizes: an error over 1e-5 plus 1e-4 of
    the row's largest value compared (:func:`~kiln.core.compare.agrees`: a mask's -inf or -1e9, read from every
    row, alike in both is equal and scales nothing; where one of them holds it and the other not, the rows
    differ)."""
    rows = feed_rows(feed)
    masks = {k: masks_of(v) for k, v in got.items() if v.shape[:1] == (rows,)}  # read from every row, once
    if rows < 2 or not masks:
        return []
    mixed: set[str] = set()
    seen: set[bytes] = set()  # samples run alone: a batch that repeats held-out rows repeats their answers
    for row in probed_rows(rows):
        sample = feed_take(feed, slice(row, row + 1))
        key = b"".join(np.ascontiguousarray(v).tobytes() for v in sample.values())
        if key in seen:
            continue
        seen.add(key)
        try:
            alone = run(sample)
        except Exception:  # the reference's own error surfaces where the comparisons run it
            break
        mixed.update(_differing(got, alone, row, masks))
        if mixed == set(masks):  # every output found: no other row can add one
            break
    return [k for k in got if k in mixed]


def probed_rows(rows: int) -> list[int]:
    """The rows of a batch of ``rows`` that :func:`mixed_rows` runs alone: every one up to :data:`MIXED_ROWS`,
    else that many spread evenly from the first to the last. Bounded, since each is a call of the reference at
    batch 1 (a large model's forward), whatever the largest validated batch; the last always, since a row that
    reads only the rows before it (a causal model over axis 0) agrees on the first rows by construction."""
    return sorted({int(i) for i in np.linspace(0, rows - 1, min(rows, MIXED_ROWS)).round()})


def _differing(
    got: dict[str, np.ndarray], alone: dict[str, np.ndarray], row: int, masks: dict[str, Masks]
) -> list[str]:
    """The outputs of ``masks`` (those of one row per sample in the batch ``got``, with their mask fills) whose
    ``row`` differs from that row run ``alone``; one of another shape alone is another probe's
    (:func:`batch_coupled`)."""
    out = []
    for k, m in masks.items():
        v = got[k]
        if k in alone and alone[k].shape[1:] == v.shape[1:] and not agrees(v[row], alone[k][0], 1e-5, 1e-4, m)[0]:
            out.append(k)
    return out


def batched(fn: Callable[[Feed], dict[str, np.ndarray]], feed: Feed, batch: int) -> dict[str, np.ndarray]:
    """``fn`` over ``feed`` in batches of rows, outputs concatenated by name; a scalar output (one value per batch,
    :func:`batch_coupled`) becomes one row per batch."""
    parts = [fn(feed_take(feed, slice(i, i + batch))) for i in range(0, feed_rows(feed), batch)]
    return {k: np.concatenate([np.atleast_1d(p[k]) for p in parts]) for k in parts[0]}


def one_call_shape(output: np.ndarray, rows: int) -> list[int]:
    """The shape of ``output`` as one call on all ``rows`` samples gives it: a time-major ``[T, N, C]`` run in
    batches (:func:`batched`) has them stacked along T (``[calls * T, batch, C]``), said as ``[T, rows, C]``; any
    other output as it is."""
    shape = [int(d) for d in output.shape]
    if len(shape) != 3 or shape[0] == rows or not 0 < shape[1] <= rows:
        return shape
    calls = -(-rows // shape[1])
    return [shape[0] // calls, rows, shape[2]] if shape[0] % calls == 0 else shape


def sample_batch(x: Any, batch: int) -> Any:
    """``batch`` rows of ``x`` (an array or a feed), repeating its rows when it has fewer."""
    if isinstance(x, dict):
        return {k: sample_batch(v, batch) for k, v in x.items()}
    reps = -(-batch // len(x))
    return np.concatenate([x] * reps)[:batch]


# Shares of counted rows (113/150 - 110/150 = 0.020000000000000018) compared with a gate: a drop of exactly the
# gate passes it, as the report's threshold says
COUNT_SLACK = 1e-9
# Precisions of calibrated ranges, which may move an output's scale as a whole (rel_err_limits)
LOWBIT = ("int8", "fp8")


def gated_list(gates: dict[str, Any]) -> list[str] | None:
    """The outputs ``validate.gates.gated_outputs`` lists, as :func:`gates_for` records them (None: every output)."""
    names = gates.get("gated_outputs")
    return list(names) if isinstance(names, list) else None


def gates_for(cfg: CheckConfig | GatesConfig, precision: str, no_class_logits: bool = False) -> dict[str, Any]:
    """The gates an engine of ``precision`` is held to: the defaults with that precision's overrides merged in. A
    model with ``no_class_logits`` (a regression's values, whose task no top-1 agreement guards) gets a concrete
    ``max_rel_err`` where none is set (:func:`derived_rel_err`), held by every float output. With class logits it
    stays as set: unset, :func:`rel_err_limits` holds every float output but 8-bit softmax class logits to the
    derived one.
    ``gated_outputs`` is in the gates only where set (:func:`accuracy_failures` reads it; absent: every output)."""
    gates = (cfg.gates if isinstance(cfg, CheckConfig) else cfg).of_precision(precision)
    if no_class_logits and gates.get("max_rel_err") is None:
        gates["max_rel_err"] = derived_rel_err(gates)
    return gates


def derived_rel_err(gates: dict[str, Any]) -> float:
    """The relative error the gates' ``min_cosine`` allows (:func:`kiln.stages.accuracy.config.derived_rel_err`)."""
    return rel_err_of_cosine(gates["min_cosine"])


def rel_err_limits(
    per_output: dict[str, dict[str, Any]], gates: dict[str, Any], precision: str = "fp32"
) -> dict[str, float]:
    """Each float output's relative-error limit: ``max_rel_err`` where the gates set one (the user's, or a model's
    without class logits: :func:`gates_for`); else :func:`derived_rel_err`, per output, for every float output but,
    in an 8-bit engine, the class logits. The outputs beside them (a detector's boxes, a regression head) are
    values, which cosine cannot hold: boxes in pixels share the anchor grid, and keep a cosine near 1 whatever the
    regression does. The class logits' scale is their softmax's confidence, which an FP32 or FP16 engine keeps (a
    logit 1.5 times the reference's has a cosine of 1 and the same argmax); an INT8 or FP8 engine's calibrated
    ranges may move it as a whole, and there their top-1 agreement and the accuracy guard them. The class logits
    are the float output with a top-1 agreement (:func:`compare_all` keeps it on them alone), or the only float
    output (class logits with no top-1 to agree on: one value per row). A binary classifier's one logit (noted
    ``decision_at``: :class:`KeptStats`) is no softmax's: its value is the probability answered (a click rate),
    which a scale or shift moves while its decision and any ranking keep, so it is held as the other outputs are."""
    floats = [n for n, s in per_output.items() if holds_floats(s)]
    if gates.get("max_rel_err") is not None:
        return dict.fromkeys(floats, gates["max_rel_err"])
    logits = [n for n in floats if per_output[n].get("top1_agreement") is not None]
    exempt = set(logits) if logits else set(floats[:1]) if len(floats) == 1 else set()
    if precision not in LOWBIT:
        exempt = set()
    exempt = {n for n in exempt if per_output[n].get("decision_at") is None}
    return {n: derived_rel_err(gates) for n in floats if n not in exempt}


def systematic_limits(
    per_output: dict[str, dict[str, Any]], gates: dict[str, Any], precision: str = "fp32"
) -> dict[str, float]:
    """Each output's limit of its error's systematic part (``max_systematic_err``; none where it is null): the
    outputs :func:`rel_err_limits` holds, whose values (scale and level too) are the answer. By default that spares
    an 8-bit engine's softmax class logits: their calibrated ranges may move their scale as a whole, which is a
    line off got = ref, and top-1 agreement and the accuracy guard them."""
    limit = gates.get("max_systematic_err")
    return {} if limit is None else dict.fromkeys(rel_err_limits(per_output, gates, precision), limit)


def holds_floats(stats: dict[str, Any]) -> bool:
    """Whether an output's recorded statistics are a float output's, held to its cosine and errors: it has a cosine,
    or no share of equal values (an output without a batch axis, a 0-D loss, has neither: one value has no
    direction), where an integer output has its share of equal values in place of a cosine."""
    return stats.get("cosine") is not None or stats.get("top1_agreement") is None


def labels_at_points(
    labels: np.ndarray | None,
    feed: Feed,
    feeds: list[tuple[dict[str, int], Feed]],
    axes: Axes,
    follows: dict[int, str] | None = None,
) -> list[np.ndarray | None]:
    """The held-out labels at each validated shape: labels per row as they are; labels per position follow the axes
    the class logits' positions lie on (``follows``: label axis -> name, where known) or else the input they are
    shaped like (a token classifier's ``[N, seq]`` tags follow ``input_ids``): cut (from the end where the input's
    attention mask shows left padding) or repeated as the input is (:func:`kiln.core.shapes.resize`; padded with
    ``IGNORE_LABEL`` where the input is padded) (:func:`label_axes`). None at a shape they cannot follow,
    and where inputs on different axes tie, at a shape where those would give other labels."""
    if labels is None or not follows_positions(labels, sizes=input_sizes(feed)):
        return [labels] * len(feeds)
    options = label_axes(labels, feed, axes, follows)
    left = left_padded(feed, axes)  # cut from the end where the input's rows are, as the input is
    masks = {k: v for k, v in feed.items() if is_mask_name(k) and k in axes and len(v) == len(labels)}
    out: list[np.ndarray | None] = []
    for point, resized in feeds:
        if options:  # beside the masks and lengths, so labels repeat each row's real positions as its tokens do
            lengths = {k: feed[k] for k in length_inputs(feed, axes, point) if len(feed[k]) == len(labels)}
            ys = [
                resize(
                    {**masks, **lengths, "y": labels},
                    {**{k: axes[k] for k in masks}, "y": dims},
                    point,
                    IGNORE_LABEL,
                    left=left,
                )["y"]
                for dims in options
            ]
            out.append(ys[0] if all(np.array_equal(ys[0], y) for y in ys[1:]) else None)
        else:  # e.g. pixel labels [N, H, W] of images [N, 3, H, W]: only at the data's own shape
            out.append(labels if all(resized[k].shape == v.shape for k, v in feed.items()) else None)
    return out


def label_axes(
    labels: np.ndarray, feed: Feed, axes: Axes, follows: dict[int, str] | None = None
) -> list[dict[int, str]]:
    """The dynamic axes labels per position may follow (label axis -> name): those of the inputs shaped like the
    labels, each distinct one; of those, the one ``follows`` names (the class logits' positions) where it is
    among them. Several: inputs on different axes tie (a source and a target of one length) and no name decides;
    an input with no dynamic axis counts only where none has one. Empty: no input is shaped like them."""
    options: list[dict[int, str]] = []
    for name, value in feed.items():
        dims = {int(i): n for i, n in (axes.get(name) or {}).items() if n != "batch"}
        if value.shape == labels.shape and dims not in options:
            options.append(dims)
    if follows and follows in options:
        return [dict(follows)]
    named = [dims for dims in options if dims]
    return named or options[:1]


def logits_positions(output_axes: Axes | None, logits: str | None, labels: np.ndarray) -> dict[int, str]:
    """Label axis -> the name of the class logits' axis it lies along, from ``output_axes`` (output -> {axis:
    name}): the logits' axes without their class axis (:func:`class_axis`), as labels per position have them."""
    dims = {int(i): n for i, n in ((output_axes or {}).get(logits or "") or {}).items()}
    ndim = labels.ndim + 1
    skip = class_axis(ndim) % ndim
    return {j: dims[k] for j, k in enumerate(i for i in range(ndim) if i != skip) if k in dims and j > 0}


def followed_axes(points: list[dict[str, int]], outputs: list[dict[str, np.ndarray]]) -> dict[str, dict[int, str]]:
    """Output -> {axis: name} for each output axis whose size varies over the validated ``points`` and is that
    axis's size at every one; an axis as long as two named axes at every point has no name here."""
    found: dict[str, dict[int, str]] = {}
    for name in outputs[0] if outputs else {}:
        shapes = [np.shape(out[name]) for out in outputs if name in out]
        if len(shapes) != len(points) or len({len(s) for s in shapes}) != 1:
            continue
        for axis in range(1, len(shapes[0])):
            sizes = [s[axis] for s in shapes]
            if len(set(sizes)) < 2:
                continue
            names = [k for k in points[0] if all(p.get(k) == size for p, size in zip(points, sizes))]
            if len(names) == 1:
                found.setdefault(name, {})[axis] = names[0]
    return found


def known_output_axes(
    given: Axes | None, points: list[dict[str, int]], outputs: list[dict[str, np.ndarray]]
) -> dict[str, dict[int, str]]:
    """The outputs' axis names: those ``given`` (the exported graph's) that name a validated axis, and those the
    reference's outputs show over the validated ``points`` (:func:`followed_axes`), which win."""
    names = {k for p in points for k in p}
    out = {o: {int(i): n for i, n in dims.items() if n in names} for o, dims in (given or {}).items()}
    for o, dims in followed_axes(points, outputs).items():
        out.setdefault(o, {}).update(dims)
    return {o: dims for o, dims in out.items() if dims}


class Reference:
    """What the engines are compared with: the PyTorch model (or, started from an ONNX file, the FP32 ONNX in
    ONNX Runtime) on the held-out inputs at every validated shape, with its labels where there are any (one array
    per shape: :func:`labels_at_points`). ``score``: the index of the shape task accuracy and the metric are
    measured at (:func:`scoring_point`; negative counts from the end); None: at none, the labels fit none.
    ``axes`` and ``output_axes``: the inputs' and the outputs' axis names (the outputs' also read off the reference's
    outputs over the validated shapes: :func:`known_output_axes`), by which each output is compared without the
    padding of the attention mask on its own axis only. ``per_row``: the rows of the held-out feeds where an output
    of one value per row (``[N]``) may be a binary classifier's one logit (:func:`binary_logit`: a binary task's,
    or one the user names with no data to say otherwise), else None. ``followed``: the output float targets are
    values per position of, scored at the data's own sizes only (:func:`output_followed`)."""

    followed: str | None = None
    one_class: str | None = None  # the reference answers one class everywhere, in words (:meth:`_say_one_class`)

    def __init__(
        self,
        run: Callable[[Feed], dict[str, np.ndarray]],
        feeds: list[tuple[dict[str, int], Feed]],
        labels: list[np.ndarray | None],
        logits: str | None,
        batch: int,
        smallest: int = 1,
        targets: np.ndarray | None = None,
        metric: Metric | None = None,
        score: int | None = -1,
        data: DatasetSplits | None = None,
        named: bool = True,
        axes: Axes | None = None,
        output_axes: Axes | None = None,
    ) -> None:
        self.run, self.feeds, self.point_labels, self.logits = run, feeds, labels, logits
        self.axes: Axes = axes or {}
        self.targets, self.metric = targets, metric
        self.score = None if score is None else score % len(feeds)
        probe = probe_batch(run, feeds[0][1], batch)
        self.coupled = coupled = batch_coupled(run, feeds[0][1], batch, smallest, probe) if probe is not None else []
        self.scalars = scalar_outputs(probe)  # no batch axis: stacked one value a call (compare_all's whole)
        refuse_scalar_logits(logits, named, self.scalars, list(probe or {}))
        if coupled:  # compare whole batches only: a last, shorter batch gives those outputs another shape
            rows = feed_rows(feeds[0][1]) // batch * batch
            if not rows:
                _refuse_batch_of_one(run, feeds[0][1], batch, coupled)
                raise ModelError(
                    f"the outputs {coupled} follow the batch beyond their first axis (each row depends "
                    f"on the whole batch), and the data has fewer held-out rows than the largest "
                    f"validated batch ({batch})",
                    hint="give the data more held-out rows, or validate smaller signature.batch_sizes",
                )
            log.info(
                "outputs %s depend on the whole batch: compared on %d held-out rows (whole batches of %d)",
                coupled,
                rows,
                batch,
            )
            self.feeds = [(point, feed_take(feed, slice(0, rows))) for point, feed in feeds]
            self.point_labels = [None if y is None else y[:rows] for y in labels]
            self.targets = None if targets is None else targets[:rows]
            if metric is not None:
                log.warning(
                    "validate.metric receives outputs %s stacked batch by batch (%d batches of %d rows: rows "
                    "i*%d to i*%d+%d are batch i's), since each of their rows depends on its whole batch: a metric "
                    "over them (a retrieval score over an [images, texts] matrix) should score each batch's block",
                    coupled,
                    rows // batch,
                    batch,
                    batch,
                    batch,
                    batch - 1,
                )
        self.outputs = [batched(run, feed, batch) for _, feed in self.feeds]  # the largest batch, every shape
        self.output_axes = known_output_axes(output_axes, [p for p, _ in self.feeds], self.outputs)
        self._say_padding_ties()
        # one value per row ([N], no class axis) is a binary classifier's one logit in a binary task, or where the
        # user names it with no data to say otherwise (the direct commands)
        rows = feed_rows(self.feeds[-1][1])
        self.per_row = rows if (binary_task(data) if data is not None else named) else None
        if self.logits is None and not named:
            self.logits = binary_default(self.outputs[-1], data, rows) or multi_label_default(self.outputs[-1], data)
        if self.logits is not None:
            self.logits = top1_output(self.logits, data, named, self.outputs[-1].get(self.logits), self.per_row)
            self._refuse_batch_classes(named, batch, smallest)
        if self.logits is not None:
            self._drop_unfollowed_labels()
            if named:
                self._drop_misfit_labels()
        self.multi_label = self._multi_label(data)
        self.binary_at = self._binary_decisions()
        self.levels = level_outputs(self.outputs[-1], self.logits)  # integer outputs held to their error
        self._at: dict[tuple[int, int], dict[str, np.ndarray]] = {}
        scored = None if self.score is None else self.outputs[self.score]
        self.accuracy = None if scored is None else self.accuracy_of(scored)
        self.metric_value = None if scored is None else self.metric_of(scored)
        self._say_vacuous_metric()
        self._say_one_class()

    def _refuse_batch_classes(self, named: bool, batch: int, smallest: int) -> None:
        """Class logits whose class axis is as long as the batch (:func:`class_axis_follows_batch`: CLIP's
        ``logits_per_image [images, texts]``) hold no classes: their argmax picks a row of the batch, which no class
        label names. Named in ``signature.logits_output`` beside labels, a ConfigError (without labels the name
        holds it to top-1 agreement with the reference, as asked); the default output is left out of top-1
        agreement and accuracy, said as a warning."""
        labelled = any(y is not None for y in self.point_labels)
        if (named and not labelled) or not class_axis_follows_batch(
            self.run, self.feeds[-1][1], self.outputs[-1], self.logits, batch, smallest
        ):
            return
        said = (
            f"the class axis of output '{self.logits}' is as long as the batch (one entry per row of it, as an "
            "[images, texts] similarity's), not classes"
        )
        if named:
            raise ConfigError(
                f"{said}: signature.logits_output names it as class logits",
                hint="name an output whose last axis holds the classes in signature.logits_output, or leave it "
                "unset and score the outputs with validate.metric (a retrieval score over the batch)",
            )
        log.warning("%s: no top-1 agreement or task accuracy is measured on it (validate.metric can score it)", said)
        self.logits = None

    def _multi_label(self, data: DatasetSplits | None) -> bool:
        """Whether the class logits are a multi-label head's (:func:`multi_hot`: float multi-hot targets shaped like
        them, in ``data`` that declares classes: ``num_classes`` given, as a one-logit decision needs it), held to
        decision agreement in place of top-1 agreement (:func:`compare_all`'s ``decisions``); said once. Without
        ``num_classes`` float 0/1 targets are a regression's (:func:`regression`), whose threshold is the user's."""
        at = self.outputs[-1 if self.score is None else self.score]
        classes = data is not None and data.num_classes > 0
        if not classes or self.logits is None or not multi_hot(self.targets, at.get(self.logits)):
            return False
        log.info(
            "class logits '%s' are a multi-label head's (float multi-hot targets shaped like them): held to decision "
            "agreement, the share of (sample, label) pairs whose decision (the logit above %g) is the reference's, "
            "by min_top1_agreement, in place of top-1 agreement",
            self.logits,
            decision_threshold(at[self.logits]),
        )
        return True

    def _binary_decisions(self) -> float | None:
        """Where the class logits are a binary classifier's one logit (:func:`binary_logit`: ``[N, 1]``, or ``[N]``
        where :attr:`per_row` says one value per row is one): the threshold its decision is taken at
        (:func:`~kiln.stages.accuracy.metrics.decision_threshold` of the reference's values at the scored point, as
        :func:`compare_all` takes it), with the 0/1 targets, one per row, as the labels its accuracy is scored
        against where the data gave no integer labels (float 0/1 targets, as ``binary_cross_entropy_with_logits``
        takes them). None: no such output."""
        at = self.outputs[-1 if self.score is None else self.score]
        if not binary_logit(at.get(self.logits or ""), self.per_row):
            return None
        if all(y is None for y in self.point_labels) and (y := binary_labels(self.targets)) is not None:
            self.point_labels = [y] * len(self.feeds)
        return decision_threshold(at[self.logits])

    def _say_vacuous_metric(self) -> None:
        """Warn where the reference's own task accuracy, or its metric where higher is better (a recall), is 0: no
        engine can drop below it, so max_accuracy_drop or max_metric_drop passes every engine; the model is
        untrained, or the labels or the metric read outputs they do not belong to. (A metric that is not finite
        is an error already: :class:`Metric`.)"""
        if self.accuracy == 0.0:
            log.warning(
                "task accuracy is 0 for the reference itself: no engine can score lower, so max_accuracy_drop passes "
                "every engine whatever it computes; check that the model is trained and that the labels are the "
                "classes of output '%s' (signature.logits_output)",
                self.logits,
            )
        if self.metric is None or self.metric_value != 0.0 or not self.metric.higher_is_better:
            return
        log.warning(
            "validate.metric '%s' is 0 for the reference itself: no engine can score lower, so max_metric_drop "
            "passes every engine whatever it computes; check that the metric reads the right outputs and labels%s",
            self.metric.name,
            " (detection_recall: name the class scores in signature.logits_output, labels [N, M, 5] of (class, x1, "
            f"y1, x2, y2); {BOX_FORMAT})"
            if self.metric.name == "detection_recall"
            else "",
        )

    def _say_one_class(self) -> None:
        """Warn where the reference puts one class on top at every row (every position, for logits per position):
        top-1 agreement then asks an engine only to keep that class on top, which an engine far off often still
        does, and the cosine is the offset's; the model is untrained, or one class dominates its head (a CTC blank),
        or the held-out rows are all of one class."""
        at = self.outputs[-1 if self.score is None else self.score]
        logits = at.get(self.logits or "")
        if logits is None or self.multi_label or logits.dtype.kind != "f":
            return
        if self.binary_at is not None:
            self._say_one_side(logits, self.binary_at)
            return
        axis = class_axis(logits.ndim)
        if logits.ndim < 2 or logits.shape[axis] < 2:
            return
        top = np.argmax(logits, axis=axis)
        if top.size < MIN_ONE_CLASS or not (top == top.flat[0]).all():
            return
        labels = self.point_labels[-1 if self.score is None else self.score]
        y = np.asarray(labels) if labels is not None else np.empty(0)
        y = y[y != IGNORE_LABEL]  # positions without a label
        if y.size and (y == top.flat[0]).all():
            log.warning(  # the model is right: the held-out rows test nothing else
                "the held-out rows are all of class %d, which the reference puts on top at all %d of them: top-1 "
                "agreement only asks an engine to keep it there; hold out rows of other classes to test more",
                int(top.flat[0]),
                top.size,
            )
        else:
            where = "rows" if top.ndim == 1 else "positions"
            self.one_class = (
                f"puts class {int(top.flat[0])} of output '{self.logits}' on top at all {top.size} of its {where}"
            )
            log.warning(
                "the reference %s: top-1 agreement only asks an engine to keep it there, which a wrong engine may "
                "still do; check that the model is trained, or gate by a metric that reads the rest (validate.metric)",
                self.one_class,
            )

    def _say_one_side(self, logits: np.ndarray, at: float) -> None:
        """Warn where a binary classifier's one logit decides alike at every row (every value on one side of the
        threshold ``at``): top-1 agreement then asks an engine only to keep the values on that side, which an engine
        answering a constant does, and accuracy is the share of the majority class; the model is untrained or
        predicts the prior. A metric that ranks the rows, or scores the rarer class, reads the rest: the one
        ``validate.metric`` sets, where it is set, else one the warning suggests."""
        decisions = np.asarray(logits).reshape(-1) > at
        if decisions.size < MIN_ONE_CLASS or not (decisions == decisions[0]).all():
            return
        side = "positive" if decisions[0] else "negative"
        self.one_class = f"decides {side} at all {decisions.size} rows of output '{self.logits}'"
        log.warning(
            "the reference %s (every value %s %g): decision agreement only asks an engine to keep them on that side, "
            "which an engine answering a constant does; check that the model is trained%s",
            self.one_class,
            "above" if decisions[0] else "at or below",
            at,
            f"; validate.metric ({self.metric.name}) is the gate that counts here, held by max_metric_drop"
            if self.metric is not None
            else ", or gate by a metric that reads the rest: validate.metric as your own 'module:function' that ranks "
            "the rows (a ROC AUC of the logit), or multilabel_f1 (the positive class's F1, with [N, 1] 0/1 targets)",
        )

    def _say_padding_ties(self) -> None:
        """Warn once per output whose padding no axis name decides (:func:`kiln.core.labels.mask_of`): it is
        compared at every position, padding included."""
        ties: dict[str, list[str]] = {}
        for (_, feed), out in zip(self.feeds, self.outputs):
            for name, tied in padding_ties(feed, out, self.axes, self.output_axes).items():
                ties.setdefault(name, tied)
        for name, tied in ties.items():
            log.warning(
                "output '%s' is as long as inputs %s, which lie on different axes, and the axis names do not say which "
                "it follows: its padding is not left out (every position is compared, padding too); name each "
                "input's axis in signature.dynamic_axes (e.g. {%s: {1: enc}, %s: {1: dec}})",
                name,
                " and ".join(f"'{t}'" for t in tied),
                tied[0],
                tied[1],
            )

    def _drop_misfit_labels(self) -> None:
        """Labels that do not fit the class logits ``signature.logits_output`` names (a question-answering head's
        ``start_logits [N, seq]`` beside span labels ``[N, 2]`` that the user's loss and metric read) score no task
        accuracy, said once: the setting holds the output to top-1 agreement with the reference whatever the data
        holds. Unnamed, such labels stay :func:`check_labels_fit`'s error."""
        at = self.score if self.score is not None else len(self.outputs) - 1
        y, out = self.point_labels[at], self.outputs[at].get(self.logits or "")
        if y is None or out is None:
            return
        try:
            check_labels_fit(out, y, self.logits or "")
        except ModelError as exc:
            log.warning(
                "%s: no task accuracy is measured on them; output '%s' is held to top-1 agreement with the reference%s",
                exc.message,
                self.logits,
                "" if self.metric is not None else " (a metric of your own, validate.metric, can score such labels)",
            )
            self.point_labels = [None] * len(self.point_labels)

    def _drop_unfollowed_labels(self) -> None:
        """Labels per position that do not fit the class logits' positions score no task accuracy and mark no
        positions for top-1 agreement, which then counts every position. At the shapes where they miss only, when
        they fit the scored one (labels cut or padded along another axis that is as long there); at every shape
        when they miss the scored one (a CTC model's token ids [N, 24] beside per-frame log-probabilities
        [N, 63, 30], which a user's loss reads). Said once. Other labels that do not fit stay, for
        :func:`check_labels_fit`'s error."""
        missed = [
            i
            for i, (y, out) in enumerate(zip(self.point_labels, self.outputs))
            if self._misses(y, out, feed_rows(self.feeds[i][1]))
        ]
        if not missed:
            return
        if self.score is not None and self.score not in missed:
            log.warning(
                "the held-out labels do not follow the positions of class logits '%s' at %s: top-1 agreement "
                "counts every position the reference is confident at there; task accuracy is measured at %s",
                self.logits,
                "; ".join(_sizes(self.feeds[j][0]) or "the data's sizes" for j in missed),
                _sizes(self.feeds[self.score][0]) or "the data's sizes",
            )
            self.point_labels = [None if j in missed else y for j, y in enumerate(self.point_labels)]
            return
        # said at the shape the labels belong to (the data's own sizes, where scored), as one call on every row
        i = self.score if self.score is not None else missed[-1]
        y, shape = self.point_labels[i], one_call_shape(self.outputs[i][self.logits], feed_rows(self.feeds[i][1]))
        positions = list(np.delete(np.array(shape), class_axis(len(shape)) % len(shape)))
        rows = f"; their rows are not the samples, {len(y)}" if len(y) != shape[0] else ""
        log.warning(
            "the held-out labels %s%s do not follow the positions of class logits '%s' %s (they take labels "
            "%s%s): no task accuracy is measured, and top-1 agreement counts every position the reference is "
            "confident at",
            y.dtype,
            list(y.shape),
            self.logits,
            shape,
            positions,
            rows,
        )
        self.point_labels = [None] * len(self.point_labels)

    def _misses(self, y: np.ndarray | None, out: dict[str, np.ndarray], rows: int) -> bool:
        """Labels per position of a sequence of another length than the class logits' (targets [N, L] beside
        [N, T, C]), or labels of the ``rows`` samples beside class logits whose rows are not the samples (a CRNN's
        time-major [T, N, C], its batches stacked along T); any other misfit is :func:`check_labels_fit`'s error."""
        logits = out.get(self.logits or "")
        if y is None or logits is None or logits.ndim < 2 or y.ndim < 1:
            return False
        if len(y) == rows != len(logits):
            return True
        if logits.ndim != 3 or not per_position(y) or y.ndim != 2:
            return False
        return y.shape[1] != logits.shape[1] and y.shape != logits.shape

    @property
    def by_value(self) -> list[str]:
        """The outputs whose length the values decide (:attr:`coupled` ones with another number of rows than the
        samples: a detector's after NMS, torch.nonzero's), compared in an order of their values
        (:func:`value_ordered`)."""
        samples = feed_rows(self.feeds[-1][1])
        last = self.outputs[-1]
        return [n for n in self.coupled if n in last and last[n].ndim >= 1 and len(last[n]) != samples]

    def at_batch(self, index: int, batch: int) -> dict[str, np.ndarray]:
        """The reference on ``batch`` rows of feed ``index`` (:func:`sample_batch`): what an engine called at that
        batch size is compared with. Rows of the largest batch's outputs; where an output mixes the batch's rows
        (CLIP's image-text logits, ``[images, texts]``: :attr:`coupled`), the reference run at that batch size."""
        if not self.coupled:
            return {k: sample_batch(v, batch) for k, v in self.outputs[index].items()}
        if (index, batch) not in self._at:
            self._at[(index, batch)] = self.run(sample_batch(self.feeds[index][1], batch))
        return self._at[(index, batch)]

    def unpadded(self, feed: Feed, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``outputs`` at ``feed`` without the positions an attention mask on their own axis marks as padding
        (:func:`kiln.core.labels.without_padding`, by the inputs' and outputs' axis names)."""
        return without_padding(feed, outputs, self.axes, self.output_axes)

    @property
    def feed(self) -> Feed:
        """The inputs at the last point (the largest sizes), for latency."""
        return self.feeds[-1][1]

    @property
    def labels(self) -> np.ndarray | None:
        """The labels at the point :attr:`score` names, for accuracy: per position, cut or padded as the inputs
        are; None where there is no such point."""
        return None if self.score is None else self.point_labels[self.score]

    def accuracy_of(self, outputs: dict[str, np.ndarray]) -> float | None:
        """Task accuracy of outputs at the point :attr:`score` names (None: no class logits or no labels); of a
        binary classifier's one logit, its decision's (:func:`binary_accuracy`)."""
        if self.logits is None or self.labels is None or self.logits not in outputs:
            return None
        if self.binary_at is not None:
            return binary_accuracy(outputs[self.logits], self.labels, self.binary_at)
        check_labels_fit(outputs[self.logits], self.labels, self.logits)
        return label_accuracy(outputs[self.logits], self.labels)

    def metric_of(self, outputs: dict[str, np.ndarray]) -> float | None:
        """``validate.metric`` of outputs at the point :attr:`score` names (None: no metric configured), against
        the labels, or the reference's own outputs there where the data has none (a copy: the metric may write into
        what it is given)."""
        if self.metric is None or self.score is None:
            return None
        if getattr(self.metric, "versus_reference", False):  # a Metric's; a plain function has labels
            return self.metric(outputs, {k: np.array(v) for k, v in self.outputs[self.score].items()})
        return None if self.targets is None else self.metric(outputs, self.targets)

    def labelled(self, index: int, batch: int | None = None) -> np.ndarray | None:
        """Where feed ``index`` (``batch`` rows of it: :func:`sample_batch`) has per-position labels, the labelled
        positions, over which top-1 agreement is counted; None: every row and position counts."""
        y, (_, feed), out = self.point_labels[index], self.feeds[index], self.outputs[index]
        if y is None or not follows_positions(y, out.get(self.logits or ""), out.values(), input_sizes(feed)):
            return None
        return (y if batch is None else sample_batch(y, batch)) != IGNORE_LABEL


def check_labels_fit(logits: np.ndarray, labels: np.ndarray, name: str) -> None:
    """Labels that fit the class-logit output: one per row ([N] for logits [N, C]), or one per position (the logits'
    shape without their class axis); else a ModelError naming both shapes."""
    positions = tuple(np.delete(np.array(logits.shape), class_axis(logits.ndim) % logits.ndim))
    if logits.ndim >= 2 and tuple(labels.shape) != positions:
        raise ModelError(
            f"the held-out labels {labels.dtype}{list(labels.shape)} do not fit the class-logit output '{name}' "
            f"{list(logits.shape)}: it takes labels shaped {list(positions)}",
            hint=_misfit_labels_hint(logits, labels),
        )


def _misfit_labels_hint(logits: np.ndarray, labels: np.ndarray) -> str:
    """The fix for held-out labels that do not fit the class logits: 0/1 targets shaped like them are a multi-label
    head's; integer labels of a row each beside logits of a row each are several targets per sample (a multi-task
    model's), which only a metric of the user's reads."""
    if tuple(labels.shape) == tuple(logits.shape) and bool(np.isin(labels, (0, 1)).all()):
        return (
            "multi-label targets: cast them to float (return them as floats, y.float(), from the data function), with "
            "train.loss: torch.nn.functional:binary_cross_entropy_with_logits and validate.metric: multilabel_f1 "
            "(each label's decision is then held to agreement with the reference)"
        )
    if labels.ndim == logits.ndim == 2 and labels.dtype.kind in "iu":
        return (
            "labels of several targets per sample score no task accuracy: name the class-logit output in "
            "signature.logits_output (held to top-1 agreement with the reference) and score the targets with "
            "validate.metric, a function of your own reading each column"
        )
    return (
        "return labels that fit the model's output from the data function, or name the class-logit output in "
        "signature.logits_output"
    )


def held_out(
    data: DatasetSplits,
    to_feed: Callable[[Any], Feed],
    axes: Axes,
    shapes: dict[str, list[int]],
    max_samples: int | None,
) -> list[tuple[dict[str, int], Feed]]:
    """The held-out rows (``validate.max_samples`` at most) as named inputs at every validated shape: the sizes of
    each dynamic axis in the data (train and held-out) or ``signature.shapes``, the largest last. Past the data's own
    sizes the inputs on an axis repeat their values along it (token ids with their attention mask):
    :func:`kiln.core.shapes.resize`."""
    n = rows(data.val_x) if max_samples is None else min(max_samples, rows(data.val_x))
    feed = to_feed(take(data.val_x, slice(0, n)))
    seen = [to_feed(data.train_x), feed] if rows(data.train_x) else [feed]
    return [(p, resize(feed, axes, p, repeat_floats=True)) for p in shape_points(axis_sizes(seen, axes, shapes))]


def class_labels(data: DatasetSplits, rows: int) -> np.ndarray | None:
    """The first ``rows`` held-out labels as class indices, what task accuracy scores: integer labels as given, and
    one-hot float rows (:func:`~kiln.core.output_names.one_hot`) as their argmax over the class axis; None for other
    labels (a regression's targets)."""
    y = data.val_y
    if y is None:
        return None
    if data.classification:
        return y[:rows].numpy()
    if one_hot(y, data.num_classes):
        held = y[:rows].numpy()
        return held.argmax(class_axis(held.ndim) % held.ndim)
    return None


def held_out_reference(
    run: Callable[[Feed], dict[str, np.ndarray]],
    feeds: list[tuple[dict[str, int], Feed]],
    data: DatasetSplits,
    logits: str | None,
    cfg: CheckConfig,
    batch_sizes: list[int],
    axes: Axes,
    named: bool = False,
    output_axes: Axes | None = None,
) -> Reference:
    """The reference ``run`` on the held-out ``feeds``, with the labels and ``validate.metric`` it is judged by: what
    validation compares engines with and the precision stage compares variants with. ``logits``: the class-logit
    output ``signature.logits_output`` picks; the metric reads it, and it is held to top-1 agreement where the
    data declares classes or ``named`` (the setting names it: :func:`top1_output`). Accuracy and the metric are
    measured where the labels fit (:func:`scoring_point`), which may add the data's own sizes to the feeds. With no
    ``validate.metric``, float targets (:func:`regression`) are judged by ``mse`` where one output is the prediction
    (:func:`kiln.stages.accuracy.metrics.default_metric`): the relative error per output misses an engine that is
    close to the reference yet far worse at the task.
    ``output_axes``: output -> {axis: name}, the exported graph's (optional: the reference's outputs over the
    validated shapes show them too); labels per position follow the class logits' position axes, outputs take the
    padding of the attention mask on their own axis."""
    n = feed_rows(feeds[-1][1])
    labels = class_labels(data, n)
    metric = resolve_metric(cfg.metric, logits, cfg.metric_higher_is_better, num_classes=data.num_classes)
    targets = metric_labels(data.val_y[:n] if data.val_y is not None else None)
    if metric is not None and targets is None:
        metric = against_reference(metric)
        log.info("validate.metric '%s' scores the outputs against the reference's: the data has no labels", cfg.metric)
    own = own_feed(data, feeds, n)
    scored = labels if labels is not None else targets
    follows = label_positions(run, feeds, own, scored, logits, axes, output_axes, min(batch_sizes))
    followed = None if labels is not None else output_followed(run, feeds, own, targets, min(batch_sizes))
    feeds, score = scoring_point(scored, own, feeds, axes, metric is not None, follows, followed, labels is not None)
    point_labels = labels_at_points(labels, own, feeds, axes, follows)
    # the metric reads the outputs at the scored point: per-position targets follow the inputs there too
    if targets is not None and score is not None:
        at_score = labels_at_points(targets, own, [feeds[score]], axes, follows)[0]
        targets = targets if at_score is None else at_score
    ref = Reference(
        run,
        feeds,
        point_labels,
        logits,
        max(batch_sizes),
        min(batch_sizes),
        targets,
        metric,
        score,
        data,
        named,
        axes,
        output_axes,
    )
    ref.followed = followed
    gated_outputs(cfg.gates.gated_outputs, list(ref.outputs[-1]))  # a misspelt name: said before any variant is made
    if metric is None and ref.targets is not None and ref.score is not None and regression(data):
        ref.metric = default_metric(ref.outputs[ref.score], ref.targets, logits)
        ref.metric_value = ref.metric_of(ref.outputs[ref.score])
        if ref.metric is not None:
            log.info(
                "validate.metric unset: float targets judged by mse (the reference's %.4g), its rise over the "
                "targets' variance gated by max_metric_drop (set validate.metric to judge them by another)",
                ref.metric_value,
            )
    ref.metric = scaled_by(ref.metric, ref.targets)
    if ref.score is not None:  # a decision threshold is the reference's, the same for every engine
        ref.metric = decided_by(ref.metric, ref.outputs[ref.score])
    return ref


def label_positions(
    run: Callable[[Feed], dict[str, np.ndarray]],
    feeds: Points,
    own: Feed,
    labels: np.ndarray | None,
    logits: str | None,
    axes: Axes,
    output_axes: Axes | None,
    batch: int,
) -> dict[int, str] | None:
    """Label axis -> the name of the axis the class logits' positions lie on, for labels per position to follow
    (:func:`labels_at_points`): from ``output_axes``, or, where inputs on different axes are shaped like the labels
    (an encoder-decoder whose source and target have one length), from the reference run on ``batch`` rows at each
    validated shape. Where that leaves the axis unknown, said: the labels are used only at the shapes where the
    tied inputs agree."""
    if labels is None or logits is None or not follows_positions(labels, sizes=input_sizes(own)):
        return None
    follows = logits_positions(output_axes, logits, labels)
    if not follows and len(label_axes(labels, own, axes)) > 1:
        try:
            outs = [run(sample_batch(feed, batch)) for _, feed in feeds]
        except Exception:  # the reference's own error surfaces where the comparisons run it
            outs = []
        follows = logits_positions(known_output_axes(None, [p for p, _ in feeds], outs), logits, labels)
    tie = len(label_axes(labels, own, axes, follows)) > 1
    if tie and any(y is None for y in labels_at_points(labels, own, feeds, axes, follows)):
        tied = [k for k, v in own.items() if v.shape == labels.shape and axes.get(k)]
        log.warning(
            "the held-out labels %s are shaped like inputs %s, which lie on different axes, and class logits '%s' "
            "do not show which they follow: labels are used only at the validated shapes where those give the same "
            "labels; name the logits' axes (the exported graph's output axes) to use them at every shape",
            _shape(labels),
            " and ".join(f"'{k}'" for k in tied),
            logits,
        )
    return follows or None


Points = list[tuple[dict[str, int], Feed]]


def scoring_point(
    labels: np.ndarray | None,
    own: Feed,
    feeds: Points,
    axes: Axes,
    metric: bool,
    follows: dict[int, str] | None = None,
    followed: str | None = None,
    task: bool = True,
) -> tuple[Points, int | None]:
    """The feeds, and the index of the one task accuracy and the metric (``metric``: one is configured) are
    measured at: the data's own sizes, the inputs the labels were given for (:func:`own_scoring_point`). Labels
    per position that follow an input (a tagger's ``[N, seq]``, a causal LM's next tokens) fit any shape too, cut
    or tiled with it, but a tiled row is another text than the one labelled (a context that repeats itself makes
    the next tokens easy): they are scored elsewhere only where the data's own sizes lie outside the validated
    ranges, at the last shape they fit. Pixel labels ``[N, H, W]`` of images ``[N, 3, H, W]`` fit only the data's
    own sizes, since a cut or padded image is labelled by no array of them: outside the validated ranges accuracy
    and the metric are measured nowhere (None), said as a warning: their gates are not applied. So are float targets
    that are values per position of output ``followed`` (an upscaler's images ``[N, 3, 2H, 2W]``:
    :func:`output_followed`). ``follows``: the axes the class logits' positions lie on (:func:`labels_at_points`).
    ``task``: the labels are classes, scored by task accuracy (else float targets, by the metric alone)."""
    if labels is None:
        return feeds, len(feeds) - 1
    if followed is not None:
        fit = at_own_shape(own, feeds)
    elif not follows_positions(labels, sizes=input_sizes(own)):
        return own_scoring_point(own, feeds, axes, metric, len(feeds) - 1, task=task)
    else:
        fit = [i for i, y in enumerate(labels_at_points(labels, own, feeds, axes, follows)) if y is not None]
    if fit:
        return own_scoring_point(own, feeds, axes, metric, fit[-1], labels, task)
    point, added = own_point(own, axes), with_own_point(own, feeds, axes)
    if added is None:
        ranges = axis_ranges([p for p, _ in feeds])
        log.warning("%s", unscored(labels, point, ranges, metric, followed))
        return feeds, None
    _say_own_point(point, metric, labels, task)
    return added


def at_own_shape(own: Feed, feeds: Points) -> list[int]:
    """The indices of the feeds whose every input has its shape in ``own``, the data's own sizes."""
    return [i for i, (_, feed) in enumerate(feeds) if all(feed[k].shape == v.shape for k, v in own.items())]


def output_followed(
    run: Callable[[Feed], dict[str, np.ndarray]], feeds: Points, own: Feed, targets: np.ndarray | None, batch: int
) -> str | None:
    """The output float ``targets`` are values per position of (:func:`~kiln.core.labels.follows_output`: an
    upscaler's images), read from the reference run on ``batch`` rows at the data's own sizes and at the smallest
    and largest validated shapes; None where the targets are no such values, or the run fails there (the
    reference's own error surfaces where the comparisons run it)."""
    if targets is None or targets.ndim < 2 or not floating(targets):
        return None
    try:
        at_own = run(sample_batch(own, batch))
        others = [run(sample_batch(feed, batch)) for _, feed in (feeds[0], feeds[-1])]
    except Exception:
        return None
    return follows_output(targets, at_own, others)


def own_scoring_point(
    own: Feed,
    feeds: Points,
    axes: Axes,
    metric: bool,
    fallback: int,
    labels: np.ndarray | None = None,
    task: bool = True,
) -> tuple[Points, int]:
    """Where labels that fit other sizes too (per row, or per position following an input: ``labels``) are scored:
    the data's own sizes, the inputs the labels were given for (audio padded with silence or an image padded with
    black is another input, whose label may differ; a text tiled to a longer length repeats itself). The last
    validated shape with those sizes; else, where they lie within every axis's validated range, a shape of their
    own added to the feeds; else ``fallback`` (the last shape the labels fit), said as a warning (the inputs there
    are cut or lengthened from the data's: :func:`_resized_said`). ``task``: the labels are classes, scored by task
    accuracy (else float targets, by the metric alone)."""
    point = own_point(own, axes)
    same = [i for i, (p, _) in enumerate(feeds) if all(p.get(k) == v for k, v in point.items())]
    if same:
        return feeds, same[-1]
    added = with_own_point(own, feeds, axes)
    if added is None:
        log.warning(
            "%s measured at %s, the held-out inputs%s %s from the data's own sizes (%s), which lie outside the "
            "validated ranges: add the data's sizes to signature.shapes to score the inputs as labelled",
            _scores_said(metric, task),
            _sizes(feeds[fallback][0]),
            "" if labels is None else " and their labels",
            _resized_said(point, feeds[fallback][0]),
            _sizes(point),
        )
        return feeds, fallback
    _say_own_point(point, metric, labels, task)
    return added


def _scores_said(metric: bool, task: bool) -> str:
    """What is measured at the scoring point, in words: task accuracy where the labels are classes, and the metric."""
    if not task:
        return "the metric"
    return "task accuracy and the metric" if metric else "task accuracy"


def _resized_said(own: dict[str, int], point: dict[str, int]) -> str:
    """How the inputs at ``point`` were made from those at the data's own sizes ``own``, in words: cut (keeping the
    first positions, or the last where an attention mask pads on the left), lengthened by repeating their values
    (:func:`kiln.core.shapes.resize`), or both, on the axes named."""
    cut = sorted(k for k, v in point.items() if k in own and v < own[k])
    grown = sorted(k for k, v in point.items() if k in own and v > own[k])
    said = []
    if cut:
        said.append(
            f"cut along {', '.join(cut)} (keeping the first positions, the last where an attention mask pads on the "
            "left: a forecaster's window then no longer ends where its targets begin)"
        )
    if grown:
        said.append(f"lengthened along {', '.join(grown)} by repeating their values")
    return " and ".join(said) or "resized"


def _say_own_point(point: dict[str, int], metric: bool, labels: np.ndarray | None, task: bool = True) -> None:
    """Logs that accuracy (and the metric) are measured at the data's own sizes, validated as a shape of their own."""
    log.info(
        "%s measured at the data's own sizes (%s), validated beside the configured ones%s",
        _scores_said(metric, task),
        _sizes(point),
        "" if labels is None else f": the inputs the {'labels' if task else 'targets'} {_shape(labels)} were given for",
    )


def with_own_point(own: Feed, feeds: Points, axes: Axes) -> tuple[Points, int] | None:
    """The feeds with the data's own sizes (:func:`own_point`) added as a shape of their own, in size order before
    the last (which stays the largest), and its index; None where those sizes lie outside an axis's validated range
    (the engines are built for those alone)."""
    point, ranges = own_point(own, axes), axis_ranges([p for p, _ in feeds])
    if any(k in ranges and not ranges[k][0] <= v <= ranges[k][1] for k, v in point.items()):
        return None
    at = next((i for i, (p, _) in enumerate(feeds[:-1]) if sum(p.values()) > sum(point.values())), len(feeds) - 1)
    return [*feeds[:at], (point, own), *feeds[at:]], at


def input_sizes(feed: Feed) -> set[int]:
    """Every size of the inputs of ``feed`` past their batch axis: labels ``[N, K]`` with ``K`` among them may follow
    an input's positions (:func:`~kiln.core.labels.follows_positions`), whatever the axis is named (an encoder's and
    a decoder's lengths under one name too)."""
    return {int(d) for v in feed.values() if np.ndim(v) >= 2 for d in np.shape(v)[1:]}


def own_point(own: Feed, axes: Axes) -> dict[str, int]:
    """The data's own size of each dynamic axis besides the batch (by name, as the validated shapes have them),
    read from the inputs at their own shape."""
    point: dict[str, int] = {}
    for name, dims in axes.items():
        for axis, label in dims.items():
            if name in own and int(axis) < own[name].ndim and label != "batch":
                point.setdefault(label, int(own[name].shape[int(axis)]))
    return point


def axis_ranges(points: list[dict[str, int]]) -> dict[str, tuple[int, int]]:
    """Each dynamic axis's validated range over ``points``: its smallest and largest size."""
    names = {k for p in points for k in p}
    return {k: (min(p[k] for p in points if k in p), max(p[k] for p in points if k in p)) for k in names}


def unscored(
    labels: np.ndarray,
    point: dict[str, int],
    ranges: dict[str, tuple[int, int]],
    metric: bool,
    followed: str | None = None,
) -> str:
    """Why accuracy (and the metric) go unmeasured: the data's own sizes, the only ones its labels per position
    fit, lie outside the validated ranges the engines are built for. ``followed``: the output float targets are
    values per position of (:func:`output_followed`), scored by a metric alone."""
    validated = ", ".join(f"{k} {lo}..{hi}" for k, (lo, hi) in sorted(ranges.items()))
    if followed is not None:
        what = (
            "validate.metric is not measured and max_metric_drop is not applied" if metric else "no metric is measured"
        )
        held = f"targets {_shape(labels)} are values per position of output '{followed}'"
    else:
        what = "task accuracy and validate.metric are" if metric else "task accuracy is"
        what += " not measured and " + (
            "max_accuracy_drop and max_metric_drop are" if metric else "max_accuracy_drop is"
        )
        what += " not applied"
        held = f"labels {_shape(labels)} are per position"
    return (
        f"{what}: the held-out {held} at the data's own sizes ({_sizes(point)}), outside the validated "
        f"sizes ({validated}) the engines are built for, and {'targets' if followed else 'labels'} at other sizes "
        f"would {'target' if followed else 'label'} other positions; add the data's sizes to signature.shapes to "
        "measure it"
    )


def _sizes(point: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(point.items()))


def _shape(y: np.ndarray) -> str:
    return f"{y.dtype}{list(y.shape)}"


def declares_classes(data: DatasetSplits) -> bool:
    """Whether the data says the task has classes: integer labels (a classifier's, one per row or position), or a
    ``num_classes`` given without labels (a pretrained classifier validated on unlabelled inputs)."""
    return data.classification or data.num_classes > 0


def regression(data: DatasetSplits) -> bool:
    """Float targets in a dataset that declares no classes, other than class scores: the outputs are values to
    predict, none class logits. Rows of non-negative values that each sum to 1 (one-hot or soft labels, a
    distillation's probabilities) are class scores, whose argmax is a class. Float 0/1 targets stay a regression's
    (a least-squares rate) unless ``num_classes`` is 2 (:func:`binary_task`): their threshold is the user's to say."""
    y = data.train_y if data.train_y is not None else data.val_y
    if y is None or declares_classes(data):
        return False
    rows = np.asarray(y.numpy() if hasattr(y, "numpy") else y, dtype=np.float64)
    rows = rows.reshape(len(rows), -1)
    scores = rows.shape[1] > 1 and bool((rows >= 0).all()) and bool(np.allclose(rows.sum(1), 1.0, atol=1e-3))
    return not scores


def binary_logit(output: np.ndarray | None, rows: int | None = None) -> bool:
    """A float output with a class axis (:func:`class_axis`) of one entry (``[N, 1]``), or, where ``rows`` is given
    (the rows of the batch it answers, in a task that says it is binary: :func:`binary_task`), one value per row
    without a class axis (``[N]``, a two-tower model's ``(u * v).sum(-1)``): as class logits, a binary classifier's
    one logit per row (or position), whose decision is the logit above 0; as anything else, a value per row (a
    regression's)."""
    if output is None or output.dtype.kind != "f":
        return False
    if output.ndim == 1:
        return rows is not None and len(output) == rows
    return output.ndim >= 2 and output.shape[class_axis(output.ndim)] == 1


def binary_labels(y: Any) -> np.ndarray | None:
    """``y`` (a tensor or an array) as one 0/1 label per row, ``[N]``, where it is that: ``[N]`` or ``[N, 1]`` of 0s
    and 1s (floats, as ``binary_cross_entropy_with_logits`` takes them, or integers); else None."""
    if y is None:
        return None
    a = np.asarray(y.numpy() if hasattr(y, "numpy") else y)
    if a.ndim not in (1, 2) or (a.ndim == 2 and a.shape[1] != 1) or not a.size or a.dtype.kind not in "fiub":
        return None
    return a.reshape(-1) if bool(np.isin(a, (0, 1)).all()) else None


def binary_default(outputs: dict[str, np.ndarray], data: DatasetSplits | None, rows: int | None = None) -> str | None:
    """The default class-logit output (:func:`~kiln.core.outputs.logits_name`: the only output, or ``logits``) where
    it is a binary classifier's one logit (:func:`binary_logit`: ``[N, 1]``, or ``[N]`` one value per each of the
    ``rows`` the outputs answer) in a binary task (:func:`binary_task`: float 0/1 targets with ``num_classes`` 2,
    which leave a run without class logits otherwise). None elsewhere; float 0/1 targets without it beside such an
    output are warned of, once: they are judged as a regression's."""
    if data is None:
        return None
    name = logits_name(list(outputs), None)
    one_logit = name is not None and binary_logit(outputs.get(name), rows)
    if not binary_task(data):
        y = data.train_y if data.train_y is not None else data.val_y
        if one_logit and binary_labels(y) is not None and id(data) not in _SAID_RATE:
            _SAID_RATE.add(id(data))
            log.warning(
                "float 0/1 targets beside the one-value output '%s': judged as a regression's (a rate, by its "
                "error); for a one-logit classifier, num_classes=2 in DatasetSplits holds its decision (the logit "
                "above 0) to top-1 agreement and accuracy",
                name,
            )
        return None
    return name if one_logit else None


_SAID_RATE: set[int] = set()  # datasets whose float 0/1 targets were warned of (binary_default)


def binary_task(data: DatasetSplits) -> bool:
    """Whether the data says the task is a binary classification, whose class logits may be one logit per row:
    ``num_classes`` 2, or integer 0/1 labels (:func:`binary_labels`). Float 0/1 targets alone do not: a model fit
    to them by least squares predicts a rate, whose decision is no logit above 0."""
    y = data.train_y if data.train_y is not None else data.val_y
    return data.num_classes == 2 or (data.classification and binary_labels(y) is not None)


def multi_hot(targets: Any, output: np.ndarray | None) -> bool:
    """Float 0/1 targets (a tensor or an array) shaped like ``output`` beyond its rows, whose class axis
    (:func:`class_axis`) has two entries or more, not one-hot: a multi-label head's, trained with binary
    cross-entropy on its logits, each label a decision of its own (the logit above 0, as ``multilabel_f1`` takes
    it). Targets with exactly one 1 in every row (or position) are one-hot class labels, as training tells them
    apart: class scores whose argmax is the class, held to top-1 agreement."""
    if targets is None or output is None or output.dtype.kind != "f" or output.ndim < 2:
        return False
    y = np.asarray(targets.numpy() if hasattr(targets, "numpy") else targets)
    axis = class_axis(output.ndim)
    if y.dtype.kind != "f" or y.shape[1:] != output.shape[1:] or output.shape[axis] < 2:
        return False
    return bool(np.isin(y, (0, 1)).all()) and not bool((y.sum(axis) == 1).all())


def multi_label_default(outputs: dict[str, np.ndarray], data: DatasetSplits | None) -> str | None:
    """The default class-logit output (:func:`~kiln.core.outputs.logits_name`) where it is a multi-label head's
    (:func:`multi_hot`) and the data's ``num_classes`` is its number of labels: as for float 0/1 targets of one
    logit (:func:`binary_task`), float 0/1 targets alone may be a least-squares rate's, whose decision is no logit
    above 0. None elsewhere; a ConfigError where the data declares another ``num_classes`` than the head's width,
    which would leave the decisions ungated with no word."""
    name = logits_name(list(outputs), None)
    if data is None or name is None or not multi_hot(data.val_y, outputs.get(name)):
        return None
    width = outputs[name].shape[class_axis(outputs[name].ndim)]
    if data.num_classes > 0 and width != data.num_classes:  # the gate on each decision would be off, unsaid
        raise ConfigError(
            f"the multi-hot targets of output '{name}' hold {width} labels per row, the dataset declares "
            f"num_classes={data.num_classes}: validation holds each label's decision to agreement only where they "
            "are the same number",
            hint=f"set num_classes={width} (the label width) in DatasetSplits",
        )
    return name if width == data.num_classes else None


def binary_accuracy(logits: np.ndarray, labels: np.ndarray, at: float) -> float | None:
    """Share of the labelled rows (or positions) whose decision, a binary classifier's one logit above ``at``
    (:func:`binary_logit`), is their 0/1 label; None where the labels are no 0/1 label per decision."""
    decisions = np.asarray(logits).reshape(-1) > at  # the class axis has one entry: one decision per row
    y = np.asarray(labels).reshape(-1)
    keep = y != IGNORE_LABEL
    if y.size != decisions.size or not keep.any() or not np.isin(y[keep], (0, 1)).all():
        return None
    return float(np.mean(decisions[keep] == (y[keep] > 0.5)))


def top1_output(
    logits: str | None,
    data: DatasetSplits | None,
    named: bool = False,
    output: np.ndarray | None = None,
    rows: int | None = None,
) -> str | None:
    """The output whose argmax is a class decision, held to top-1 agreement and scored for accuracy: ``logits``
    where ``named`` (the user set ``signature.logits_output`` to it: declared class logits, unless the data's
    targets are a regression's, :func:`regression`, where it names the prediction), or where the data declares
    classes (:func:`declares_classes`; ``data`` None: inputs without labels, the direct commands') and ``output``
    (the reference's, where known) has as many entries along its class axis (:func:`class_axis`) as the data's
    ``num_classes``, or one entry in a binary task (:func:`binary_task`: a binary classifier's one logit,
    :func:`binary_logit`, which without a class axis is one value per each of ``rows``, the rows it answers); else
    None (logged; as a warning where it has one class more than the data, a no-object
    class: :func:`_say_no_object`, unless the labels are a detector's, :func:`detection_labels`, whose class scores
    hold that class). A model's only output is ``logits`` by
    default whatever it holds: without classes, or of another width, it may be an embedding (a ViT backbone without
    its head, one trained with a loss of the user's on labelled data), whose argmax is no class and whose top-1
    agreement would pass or fail an engine at random. It is then compared as outputs without class logits are:
    cosine of the whole output and of its worst sample, error and relative error."""
    if logits is not None and named and data is not None and regression(data):
        _say_named_prediction(logits, data, output)
        return None
    if logits is None or named:
        return logits
    if data is not None and detection_labels(data.val_y if data.val_y is not None else data.train_y):
        return logits  # a detector's class scores beside its boxes (class_logits), a no-object class included
    # the direct commands' user gave the inputs and sees no report: said where they look, unless the output has one
    # channel on axis 1 past two axes (a waveform [N, 1, T], a one-channel map), which holds no class scores
    loud = data is None and not (output is not None and output.ndim >= 3 and output.shape[1] == 1)
    if data is not None and binary_logit(output, rows) and binary_task(data):
        return logits  # one logit per row of a two-class task: its decision is the class
    if data is None or not declares_classes(data):
        why = (
            "the data declares no classes (no integer labels, num_classes 0)"
            if data is not None
            else "the inputs given carry no labels"
        )
    elif (data.num_classes or binary_logit(output)) and output is not None and output.ndim >= 2:
        width = output.shape[class_axis(output.ndim)]
        if width == data.num_classes:
            return logits
        if data.num_classes and width == data.num_classes + 1:
            _say_no_object(logits, width, data.num_classes)
            return None
        why = (
            f"its class axis has {width} entries and the data {data.num_classes} classes"
            if data.num_classes
            else "its class axis has 1 entry and the labels are no 0/1 label per row (a binary classifier's)"
        )
        # integer labels beside a head of a width near theirs (5 for 4 classes): a head sized for other data, most
        # likely, which training took for class logits (cross-entropy reads any width past the largest label) and
        # validation cannot; an embedding trained on the labels (metric learning) is far wider, said quietly
        loud = data.classification and (width <= 2 * data.num_classes or width == 1)
    else:
        return logits
    if output is not None and output.dtype.kind != "f":  # class ids (an argmax), flags: answers, not class scores
        log.info("output '%s' holds %s values: %s", logits, output.dtype, held_as(output))
        return None
    one = binary_logit(output)  # one column: a binary classifier's one logit, or a value; no argmax either way
    log.log(
        logging.WARNING if loud else logging.INFO,
        "output '%s' is not held to %s or scored for accuracy: it is the class-logit output by default only, and "
        "%s, so %s; compared by cosine (the whole output's and the worst sample's), max abs error and relative "
        "error. If it holds %s, %s holds %s; %s need no name",
        logits,
        "decision agreement" if one else "top-1 agreement",
        why,
        "its one column may be no logit at all (a regression's value)"
        if one
        else "its argmax may be no class at all (an embedding's)",
        "a binary classifier's one logit" if one else "class scores",
        ("num_classes=2" if one else "num_classes") + " in the data"
        if data is not None and regression(data)
        else f"naming it (signature.logits_output={logits})",
        "its decision (the logit above 0) to decision agreement" if one else "their argmax to top-1 agreement",
        "a score or other values" if one else "an image or other values",
    )
    return None


def _say_named_prediction(logits: str, data: DatasetSplits, output: np.ndarray | None) -> None:
    """Says that output ``logits``, which ``signature.logits_output`` names, is held as the prediction of the data's
    float targets (a regression's), not as class logits. Naming the prediction among several outputs (a
    forecaster's mean beside its log_var: as many values per row as the targets) is the setting's use with a
    regression, and what the warning of a tuple output asks for: said as information. A named output of several
    columns per row that the targets do not match (a multi-task model's class logits beside its other heads, whose
    data gives no num_classes) is most likely class logits left unscored: a warning (said once a run: SaidOnce)."""
    y = data.val_y if data.val_y is not None else data.train_y
    per_row = int(np.prod(y.shape[1:])) if y is not None else None
    columns = output is not None and output.ndim == 2 and output.shape[1] > 1 and output.shape[1] != per_row
    log.log(
        logging.WARNING if columns else logging.INFO,
        "output '%s', which signature.logits_output names, holds the prediction of float targets (a regression's, "
        "the data giving no num_classes): compared by cosine, error and relative error, not held to "
        "top-1 agreement or scored for accuracy; if it holds class logits (or a multi-label head's), give "
        "num_classes in the data function (DatasetSplits(..., num_classes=K))",
        logits,
    )


def _say_no_object(logits: str, width: int, num_classes: int) -> None:
    """Warns of a default class-logit output with one class more than the data declares: most likely class logits
    with a no-object class (a DETR or YOLOS detector's ``[N, queries, classes + 1]``), which only a name declares,
    since the argmax of the extra class is no class of the data's. Without it they are gated as plain values."""
    log.warning(
        "output '%s' has %d classes and the data %d (one more: a no-object class?): compared by cosine, max abs "
        "error and relative error, not held to top-1 agreement or scored for accuracy; name it in "
        "signature.logits_output (signature.logits_output=%s) to compare it as class logits",
        logits,
        width,
        num_classes,
        logits,
    )


def direct_top1(
    names: list[str], setting: str | int | None, outputs: dict[str, np.ndarray] | None = None
) -> str | None:
    """The output the direct commands (``kiln validate ENGINE``, ``kiln precision FILE``) hold to top-1 agreement:
    their inputs carry no labels, so as in a run on data that declares no classes, the one
    ``signature.logits_output`` names (a config, or ``--set``) and none by default (:func:`top1_output`, which
    reads the default's values in the reference's ``outputs``, where given: integer ones hold no class scores)."""
    name = logits_name(names, setting)
    output = None if outputs is None or name is None else outputs.get(name)
    refuse_scalar_logits(name, setting is not None, scalar_outputs(outputs), names)
    return top1_output(name, None, named=setting is not None, output=output)


def held_as(output: np.ndarray) -> str:
    """How an integer or boolean output is compared, in words: by its error where it holds levels of a quantity
    (:func:`~kiln.core.compare.integer_levels`: pixel values), else value for value (class ids, flags), to the
    share of its values equal to the reference's."""
    if integer_levels(output) is not None:
        return "levels of a quantity, held to their error as float outputs are"
    return "held to the share of its values equal to the reference's (class ids, flags: answers, not scores)"


def own_feed(data: DatasetSplits, feeds: list[tuple[dict[str, int], Feed]], n: int) -> Feed:
    """The first ``n`` held-out rows at the data's own sizes, named as in ``feeds``: what the labels are shaped by.
    No validated point need have these sizes (``signature.shapes: {seq: [4, 24]}`` on data of length 16 pads every
    row to 24 at the last one), so they are not taken from the feeds."""
    return feed_for_graph(take(data.val_x, slice(0, n)), list(feeds[0][1]))


@dataclass
class Comparison:
    """A candidate against the reference at every validated shape: statistics per output (the worst over shapes
    and batch sizes), task accuracy and metric at the shape the reference scores, the shapes it could not take,
    and what ``inspect`` found wrong with single calls."""

    stats: dict[str, OutputStats] = field(default_factory=dict)
    accuracy: float | None = None
    metric: float | None = None
    untaken: list[dict[str, int]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    last: dict[str, np.ndarray] | None = None  # the candidate's outputs at the last shape


def compare_on(
    ref: Reference,
    infer: Callable[[Feed], dict[str, np.ndarray]],
    batch_sizes: list[int],
    takes: Callable[[Feed], bool] = lambda feed: True,
    inspect: Callable[[Feed, dict[str, np.ndarray]], list[str]] | None = None,
) -> Comparison:
    """``infer`` on every held-out shape it ``takes``: all rows in batches of the largest size, then one batch of
    each size (a kernel chosen per batch size must be right too), each against the reference; task accuracy and
    the metric at the shape the reference scores (:attr:`Reference.score`). Top-1 agreement and
    the worst sample's cosine are over the held-out rows, from the first; the batches of each size, a few of those
    rows again, add their errors and cosines (a kernel that is wrong shows there) but not those: at batch 1 one
    near-tie would make top-1 0, and one sample alone has no median norm to measure a small sample's error by."""
    out = Comparison()
    largest = max(batch_sizes)
    for i, ((point, feed), expected) in enumerate(zip(ref.feeds, ref.outputs)):
        if not takes(feed):  # an axis the engine takes at one size only (recorded at its build)
            out.untaken.append(point)
            continue
        got = batched(infer, feed, largest)
        whole, answered = value_ordered(ref.unpadded(feed, expected), ref.unpadded(feed, got), ref.by_value)
        spread = spreads(whole, ref.levels)  # how the outputs vary over every held-out row: the spot checks' errors too
        per_row = ref.binary_at is not None
        kept = compare_all(
            whole,
            answered,
            ref.logits,
            ref.labelled(i),
            spread=spread,
            decisions=ref.multi_label,
            per_row=per_row,
            levels=ref.levels,
            whole=ref.scalars,
        )
        kept = with_nonfinite(with_variation(kept, whole, spread), whole, answered)
        out.stats = merge_worst(out.stats, kept)
        for bs in batch_sizes:
            feed_bs = sample_batch(feed, bs)
            got_bs = infer(feed_bs)
            if inspect is not None:
                out.problems += [p for p in inspect(feed_bs, got_bs) if p not in out.problems]
            expected_bs, got_bs = ref.unpadded(feed_bs, ref.at_batch(i, bs)), ref.unpadded(feed_bs, got_bs)
            expected_bs, got_bs = value_ordered(expected_bs, got_bs, ref.by_value)
            spot = compare_all(
                expected_bs,
                got_bs,
                ref.logits,
                ref.labelled(i, bs),
                spread=spread,
                decisions=ref.multi_label,
                per_row=per_row,
                levels=ref.levels,
                whole=ref.scalars,
            )
            out.stats = merge_worst(out.stats, {n: _batch_wide(v) for n, v in spot.items()})
        if i == ref.score:
            out.accuracy, out.metric = ref.accuracy_of(got), ref.metric_of(got)
        if i == len(ref.feeds) - 1:
            out.last = got
    return out


def _batch_wide(stats: OutputStats) -> OutputStats:
    """The statistics of one spot-check batch that hold for any rows: without the rates over the held-out rows,
    or the line of the engine's values on the reference's through them."""
    return replace(
        stats,
        top1_agreement=None,
        top1_ties=None,
        sample_cosine=None,
        worst_sample=None,
        top_class_share=None,
        worst_class=None,
        worst_class_agreement=None,
        systematic_err=None,  # a line through one batch's few rows fits their own noise (one sample's error)
        slope=None,
        shift=None,
    )


def accuracy_failures(
    entry: EngineValidation,
    gates: dict[str, Any],
    baseline_acc: float | None,
    metric: Metric | None = None,
    baseline_metric: float | None = None,
) -> list[str]:
    """Each accuracy gate ``entry`` misses, as a sentence naming the value and its threshold (NaN fails every
    gate): cosine (of the whole output, and of its worst sample: ``min_cosine`` holds for each sample), max abs
    error, relative error (:func:`rel_err_limits`) and, where that passes, the error's systematic part (a scale or
    offset: :func:`systematic_limits`) per output, top-1 agreement of the class logits (flips on
    ties counted as agreeing: :mod:`kiln.core.compare`), the task accuracy's drop and the metric's. The per-output
    gates hold the outputs ``gates["gated_outputs"]`` lists (:func:`gated_outputs`; every output where it is None or
    absent): an output the user reads no answer from (an encoder's hidden state) keeps its figures in the entry."""
    fails = []
    per_output = entry.outputs or {
        "": {"cosine": entry.cosine, "max_abs_err": entry.max_abs_err, "rel_err": entry.rel_err}
    }
    gated = gated_outputs(gates.get("gated_outputs"), list(per_output)) if entry.outputs else set(per_output)
    rel_limits = rel_err_limits(per_output, gates, entry.precision)
    line_limits = systematic_limits(per_output, gates, entry.precision)
    for name, s in per_output.items():  # per output: the worst one must pass (named when the model has several)
        if name in gated:
            # "of its values equal" needs an "it", and an integer output held to its error says so
            named = name and (len(per_output) > 1 or s["cosine"] is None or bool(s.get("levels")))
            others = [n for n in per_output if n in gated and n != name]
            accept = _accepting(name if named else "", entry.precision, others)
            where = f"output '{name}' {_levels_said(s)}" if named else ""
            said = _output_failures(where, s, gates, rel_limits.get(name), accept, entry.precision)
            if not any(f.startswith(f"{where}relative error ") for f in said):  # an error too large already fails
                said += _systematic_failures(where, s, line_limits.get(name), entry.precision)
            fails += said
    logits = [n for n, s in per_output.items() if s["cosine"] is not None and s.get("top1_agreement") is not None]
    top1 = entry.top1_agreement if not logits or logits[0] in gated else None  # the class logits' own
    if top1 is not None and not top1 >= gates["min_top1_agreement"] - COUNT_SLACK:
        fails.append(_agreement_failure(entry, gates["min_top1_agreement"]))
    if baseline_acc is not None and entry.accuracy is not None:
        drop = baseline_acc - entry.accuracy
        if not drop <= gates["max_accuracy_drop"] + COUNT_SLACK:
            fails.append(f"accuracy drop {drop:.4f} > max_accuracy_drop {gates['max_accuracy_drop']}")
    if metric is not None and baseline_metric is not None and entry.metric is not None:
        drop = metric.drop(baseline_metric, entry.metric)
        if not drop <= gates["max_metric_drop"] + COUNT_SLACK:
            fails.append(
                f"{metric.name} {entry.metric:.4g} vs {baseline_metric:.4g}: "
                f"{'relative rise' if metric.relative else 'drop'} {drop:.4g} > max_metric_drop "
                f"{gates['max_metric_drop']}"
            )
    return fails


# Each validated shape (the sizes of its dynamic axes) with the gates it misses on its own
MissedByShape = list[tuple[dict[str, int], list[str]]]


def placed_failure(failure: str, missed: MissedByShape) -> tuple[str, list[dict[str, int]]]:
    """``failure`` (of the statistics over every shape) said with the shape its value comes from and the other
    shapes that miss the same gate (``top1_agreement 0.95 < 0.97 at src=4, tgt=1 (and at src=8, tgt=2)``), and
    those shapes; as it was, with none, where no shape misses it or the shape has no sizes. Validation and the
    precision stage both place failures with it, so that a variant and its engines are blamed on the same shape."""
    worst = [point for point, fails in missed if failure in fails]
    gate = _gate_of(failure)
    points = worst + [p for p, fails in missed if p not in worst and any(_gate_of(f) == gate for f in fails)]
    if not points or not points[0]:
        return failure, []
    others = f" (and at {'; '.join(_point_said(p) for p in points[1:])})" if points[1:] else ""
    return f"{failure} at {_point_said(points[0])}{others}", points


def _gate_of(failure: str) -> str:
    """The gate a failure says it missed: its text without the numbers."""
    return re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "#", failure)


def _point_said(point: dict[str, int]) -> str:
    """A shape's sizes in the order its axes were found (``src=4, tgt=1``)."""
    return ", ".join(f"{k}={v}" for k, v in point.items())


def _levels_said(stats: dict[str, Any]) -> str:
    """What an integer output of levels (:func:`level_outputs`) is held to, as its failures say it after its name;
    empty for any other output."""
    levels = stats.get("levels")
    if not levels:
        return ""
    return f"(integer values of {int(levels)} levels: held to their error as a float output is, not to equal values) "


def _agreement_failure(entry: EngineValidation, limit: float) -> str:
    """The class logits' agreement below ``min_top1_agreement``, named for what it counts (``entry.agreement``): a
    multi-label head's decision agreement is no argmax's, and a user who reads "top-1" looks for the wrong flips."""
    ties = f" (flips on ties, counted as agreeing: {entry.top1_ties:.4f})" if entry.top1_ties else ""
    if entry.agreement == "decision":
        return f"{AGREEMENT_NAMES['decision']} {entry.top1_agreement:.4f} < min_top1_agreement {limit}{ties}"
    return f"top1_agreement {entry.top1_agreement:.4f} < {limit}{ties}"


def gated_outputs(names: list[str] | None, outputs: list[str]) -> set[str]:
    """The outputs the per-output gates hold: those ``validate.gates.gated_outputs`` lists (``names``), every one of
    ``outputs`` (the model's) where it is None; a name the model has no output of is a ConfigError naming them."""
    if names is None:
        return set(outputs)
    refuse_unknown_gated(names, outputs)
    return set(names)


def _cosine_said(stats: dict[str, Any]) -> str:
    """An output's cosine as a failure says it: NaN is no angle, but an output with no direction (all zeros) or no
    number; where one side answers NaN/inf and the other does not, which side and at which rows
    (:func:`nonfinite_said`), so that the user looks at the right graph."""
    cosine = stats["cosine"]
    if np.isfinite(cosine):
        return f"{cosine:.6f}"
    side = nonfinite_said(stats)
    return f"undefined ({side})" if side else "undefined (one side all zeros, or NaN/inf in it)"


def _accepting(name: str, precision: str, others: list[str]) -> str:
    """The settings that accept output ``name``'s relative error in an engine of ``precision``: that precision's
    ``max_rel_err``, or, beside ``others`` gated, ``gated_outputs`` without it (``name`` empty: the one output)."""
    said = f"validate.gates.per_precision.{precision}.max_rel_err"
    if precision in LOWBIT:  # a limit derived for an 8-bit engine spares the class logits; a set one holds them
        said += " (which holds its class logits too)"
    if name and others:
        said += f", or validate.gates.gated_outputs: [{', '.join(others)}] to leave '{name}' ungated"
    return said


def _output_failures(
    where: str,
    s: dict[str, Any],
    gates: dict[str, Any],
    rel_limit: float | None,
    accept: str = "",
    precision: str = "fp32",
) -> list[str]:
    """The per-output gates one output's statistics ``s`` miss, each said after ``where`` (its name, or nothing):
    the share of equal values of an integer output, else the cosine (the whole output's, then the worst
    sample's); the max abs error; the relative error, against ``rel_limit`` (:func:`rel_err_limits`), where it is
    over a small spread with the settings that ``accept`` it (:func:`_over_spread`), unless the engine's
    ``precision`` rounds that much (:func:`within_rounding`)."""
    fails = []
    if s["cosine"] is None and s.get("top1_agreement") is not None:  # integer values: equal, or not
        if not s["top1_agreement"] >= gates["min_top1_agreement"] - COUNT_SLACK:
            fails.append(
                f"{where}{s['top1_agreement']:.4f} of its values equal < min_top1_agreement "
                f"{gates['min_top1_agreement']}"
            )
    elif s["cosine"] is not None and not s["cosine"] >= gates["min_cosine"]:  # None: no batch axis (a 0-D loss)
        fails.append(f"{where}cosine {_cosine_said(s)} < min_cosine {gates['min_cosine']}")
    elif s.get("sample_cosine") is not None and not s["sample_cosine"] >= gates["min_cosine"]:
        fails.append(_sample_failure(where, s, gates["min_cosine"]))
    if gates["max_abs_err"] is not None and not s["max_abs_err"] <= gates["max_abs_err"]:
        fails.append(f"{where}max_abs_err {s['max_abs_err']:.3g} > {gates['max_abs_err']}")
    return fails + _rel_failures(where, s, rel_limit, accept, precision)


def _rel_failures(where: str, s: dict[str, Any], rel_limit: float | None, accept: str, precision: str) -> list[str]:
    """The relative error of one output over ``rel_limit``, as :func:`_output_failures` says it; none where the
    precision's own rounding accounts for it (:func:`within_rounding`), which is logged."""
    rel = s.get("rel_err")
    if rel_limit is not None and rel is not None and not rel <= rel_limit:
        if within_rounding(s, precision, rel_limit):
            log.info(
                "%srelative error %.4g > max_rel_err %.4g passes: it is over a spread between samples of only "
                "%.2f%% of its RMS, and over its norm the error, %.2g, is within %s's own rounding",
                where,
                rel,
                rel_limit,
                100 * s["norm_rel_err"] / rel,
                s["norm_rel_err"],
                precision.upper(),
            )
        else:
            said = _over_spread(s, accept, precision) or _over_norm(s)
            return [f"{where}relative error {rel:.4g} > max_rel_err {rel_limit:.4g}{said}"]
    return []


# Each float precision's own rounding of a value relative to it: its unit roundoff. FP32 is held strictly; INT8's
# and FP8's errors follow the ranges calibrated for every tensor, no constant of the format, and an allowance near
# their step (a few % of the norm) would pass a box head half off over its small spread.
ROUNDING = {"fp16": 2.0**-11, "bf16": 2.0**-8}
# Rounding errors of that size an engine's output may carry over its norm: each layer rounds again, and a network's
# output in FP16 commonly carries a few units of roundoff
ROUNDING_ERRORS = 8


def rounding_allowance(precision: str, rel_limit: float) -> float | None:
    """The error over its norm an output of an engine of ``precision`` carries from that precision's rounding alone
    (:data:`ROUNDING`, :data:`ROUNDING_ERRORS`), at most ``rel_limit``; None for a precision held strictly."""
    eps = ROUNDING.get(precision)
    return None if eps is None else min(ROUNDING_ERRORS * eps, rel_limit)


def within_rounding(stats: dict[str, Any], precision: str, rel_limit: float) -> bool:
    """Whether an output's relative error passes though over ``rel_limit``: measured over a spread between samples
    much smaller than its norm (:data:`SMALL_SPREAD`: an output that barely varies, such as a matching head's one
    logit of a little-trained model), while its error over its norm is within what ``precision``'s own rounding
    gives (:func:`rounding_allowance`). No engine of that precision could do better; an error beyond the rounding,
    or over a spread that is not small, still fails."""
    norm, rel = stats.get("norm_rel_err"), stats.get("rel_err")
    allowance = rounding_allowance(precision, rel_limit)
    if allowance is None or norm is None or rel is None or not norm > 0:
        return False
    return bool(rel > SMALL_SPREAD * norm and norm <= allowance)


# A relative error over the spread this many times the one over the norm: the spread is at most 2 % of the output's
# RMS, near SPREAD_FLOOR (held-out inputs alike); a detector's boxes over their anchor grid vary by more
SMALL_SPREAD = 50.0


def _over_spread(stats: dict[str, Any], accept: str, precision: str = "fp32") -> str:
    """Where the relative error is over a spread between samples much smaller than the output's norm (held-out
    inputs alike, or an output on a level far above its variation), what it is over and the error over the norm:
    a user sees a cosine of 0.9999999 beside the failure and needs both; where the engine's ``precision`` rounds,
    that the error is beyond its rounding (:func:`within_rounding`); and, where an error that small over the
    norm may well be acceptable, the settings that ``accept`` it (:func:`_accepting`)."""
    norm = stats.get("norm_rel_err")
    if norm is None or not norm > 0 or not stats["rel_err"] > SMALL_SPREAD * norm:
        return ""
    times = stats.get("over_variation")
    if times is not None and times > 1:  # no small error on a high level: larger than the output ever varies
        return (
            f" (its RMS error is {times:.2g}x the spread of the output between the held-out samples: larger than the "
            f"output varies, though only {norm:.2g} of its norm on a level far above that spread)"
        )
    allowance = rounding_allowance(precision, float("inf"))
    beyond = f", more than {precision.upper()}'s own rounding gives ({allowance:.2g})" if allowance else ""
    return (
        " (the RMS error over how the reference varies between the held-out samples, only "
        f"{norm / stats['rel_err']:.2%} of its RMS; over its norm the error is {norm:.2g}{beyond}: held-out inputs "
        f"that vary more measure it better{f'; to accept it, set {accept}' if accept else ''})"
    )


def _systematic_failures(where: str, s: dict[str, Any], limit: float | None, precision: str) -> list[str]:
    """The systematic part of one output's error over ``limit`` (``max_systematic_err``), said with the line the
    engine's values follow (:func:`~kiln.core.compare.systematic`): their scale against the reference's and their
    mean offset, in plain words, since that is what a user goes looking for (a calibrated range, a bias)."""
    err = s.get("systematic_err")
    if limit is None or err is None or err <= limit or within_rounding(s, precision, limit):
        return []  # an error within the precision's own rounding over the norm holds no line worth naming
    slope, shift = s.get("slope"), s.get("shift")
    scale = "off scale" if slope is None else f"{slope:.4g}x the reference's"
    scale = "at the reference's scale" if slope is not None and abs(slope - 1) < 5e-4 else scale
    offset = f"{shift:+.4g} on average (in the output's units)" if shift is not None else "off"
    over = "over its norm" if s.get("norm_rel_err") is None else "over how the reference varies between samples"
    return [
        f"{where}systematic error {err:.4g} > max_systematic_err {limit:.4g}: the engine's values are {scale} and "
        f"off by {offset}, an error of {err:.2%} {over} made alike on every sample, which is no rounding noise: "
        "look for a wrong scale or offset (a calibrated range, a dropped bias or normalization); to accept it, set "
        f"validate.gates.per_precision.{precision}.max_systematic_err"
    ]


def _over_norm(stats: dict[str, Any]) -> str:
    """What the relative error of an output without a batch axis (a 0-D loss: no cosine, no share of equal values)
    is over: its norm, there being no samples whose spread would measure it."""
    if stats.get("cosine") is not None or stats.get("top1_agreement") is not None:
        return ""
    return " (over its norm: it has no batch axis, one value a call)"


def _sample_failure(where: str, stats: dict[str, Any], limit: float) -> str:
    """The worst sample's cosine below ``min_cosine``, said with its row and the whole output's cosine (which can
    pass while one sample of many is wrong)."""
    row = stats.get("worst_sample")
    which = f" (sample {int(row)})" if row is not None else ""
    return (
        f"{where}worst sample's cosine {stats['sample_cosine']:.6f}{which} < min_cosine {limit} "
        f"(whole output: {stats['cosine']:.6f})"
    )


REFERENCE_NAN_FIX = (
    "make forward answer a number there: a softmax over a row whose scores are all -inf (a padded position whose "
    "keys are all masked) is NaN; keep one key unmasked per row, fill masked scores with a large negative number "
    "instead of -inf, or zero them with torch.nan_to_num"
)


def reference_nan(outputs: list[dict[str, np.ndarray]]) -> list[str]:
    """A warning per float output the reference itself answers NaN in, on the held-out ``outputs`` (one dict per
    validated shape): how many values, in how many rows. The comparison sets a NaN aside where the engine answers
    NaN too (:func:`~kiln.core.compare.set_aside`), so such an output passes every gate while clients receive NaN;
    the user should hear of it once, not find it in production."""
    said = []
    for name in dict.fromkeys(n for out in outputs for n in out):
        arrays = [np.asarray(out[name]) for out in outputs if name in out]
        arrays = [a for a in arrays if a.dtype.kind == "f" and a.size]
        nan = [np.isnan(a).reshape(len(a), -1) if a.ndim else np.isnan(a).reshape(1, 1) for a in arrays]
        values = sum(int(m.sum()) for m in nan)
        if not values:
            continue
        rows = sum(int(m.any(axis=1).sum()) for m in nan)
        where = f" over {len(arrays)} validated shapes" if len(arrays) > 1 else ""
        said.append(
            f"reference output '{name}' is NaN at {values} of {sum(a.size for a in arrays)} values, in {rows} of "
            f"{sum(len(m) for m in nan)} rows{where}: the model itself answers NaN there; an engine that answers NaN "
            f"at the same values passes, those values set aside and not compared, and served clients receive NaN; "
            f"{REFERENCE_NAN_FIX}"
        )
    return said
