"""PyTorch at the sizes the size checks run: the model's outputs at a size of the dynamic axes, or an error that
says why the model itself fails or answers nothing finite there and what to change (a size Kiln made by cutting the
rows, one off the steps the model takes, axes that must be tied, zero padding); for ``kiln export -o``, the size
checked in place of one the model cannot take. Apart from :mod:`.sizes`, which holds the graph to these outputs:
here the graph is not yet in question."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Mapping
from functools import cache

import numpy as np
from torch import nn

from kiln.core.data import Feed, Inputs, from_feed
from kiln.core.errors import ModelError
from kiln.core.records import steps_text, takes_size
from kiln.core.shapes import Axes, resize, shape_points
from kiln.stages.export.declaration import MAX_PERIOD
from kiln.stages.export.model_checks import nothing_finite
from kiln.stages.export.parity import torch_outputs
from kiln.stages.export.size_steps import first_probes, runs_at, size_pattern
from kiln.stages.export.torch_export import error_reason

log = logging.getLogger("kiln.export")


def own_sizes(feed: Mapping[str, np.ndarray], axes: Axes) -> dict[str, int]:
    """The size the data has on each named dynamic axis (its held-out rows'): one per name, which the data check
    holds the axes sharing it to (:func:`kiln.core.data.check_tied_sizes`)."""
    return {
        label: feed[name].shape[int(axis)]
        for name, dims in axes.items()
        if name in feed
        for axis, label in dims.items()
    }


def _untied_hint(feed: Mapping[str, np.ndarray], axes: Axes, point: Mapping[str, int], source: str = "the data") -> str:
    """The start of the fix where an axis left out of ``signature.dynamic_axes`` has the size the data gives a varied
    one: of an input left out (a forecaster's ``calendar [N, 24]`` beside ``past [N, 24, F]`` whose axis 1 is
    ``time``), or of one declared in part (a square ``spd [N, n, n]`` given ``{1: n}`` alone). It may follow that
    axis, and then Kiln must cut it too, which only a declaration tells it; empty otherwise. The declaration shown
    holds each such input's declared axes and the new ones. ``source``: what ``feed`` is, in words (``kiln export
    -o``'s example)."""
    own = own_sizes(feed, axes)
    said: list[tuple[str, int, str]] = []
    for name, array in feed.items():
        declared = {int(a) for a in axes.get(name, {})}
        for axis in range(1, array.ndim):
            label = next((k for k in point if own.get(k) == array.shape[axis]), None)
            if axis not in declared and label is not None:
                said.append((name, axis, label))
    if not said:
        return ""
    listed = ", ".join(f"input '{n}' (axis {a}: {own[lbl]} in {source}, as {lbl})" for n, a, lbl in said)
    whole: dict[str, dict[int, str]] = {}
    for n, a, lbl in said:
        whole.setdefault(n, {int(k): v for k, v in axes.get(n, {}).items()})[a] = lbl
    shown = ", ".join(
        f"{n}: {{" + ", ".join(f"{a}: {lbl}" for a, lbl in sorted(d.items())) + "}" for n, d in whole.items()
    )
    return f"if {listed} varies with it, declare that too, signature.dynamic_axes: {{{shown}}}; else "


def one_name_hint(
    feeds: list[Mapping[str, np.ndarray]], axes: Axes, point: Mapping[str, int], source: str = "the data"
) -> str:
    """The start of the fix where ``point`` gives two axes of other names other sizes that every one of ``feeds``
    (the data's; ``source`` says whose, in words) gives one size (``{input_ids: {1: seq}, attention_mask: {1:
    len}}``, both 16 in every row): one name ties axes that must be equal, and the model's code is then not at
    fault; empty otherwise."""
    sizes = [own_sizes(f, axes) for f in feeds]
    order = list(sizes[0]) if sizes else []
    pairs = [(a, b) for a in order for b in order[order.index(a) + 1 :] if a in point and b in point]
    tied = [(a, b) for a, b in pairs if point[a] != point[b] and all(a in s and s.get(b) == s[a] for s in sizes)]
    if not tied:
        return ""
    keep, drop = tied[0]
    declared = ", ".join(
        f"{name}: {{" + ", ".join(f"{ax}: {keep if lbl == drop else lbl}" for ax, lbl in dims.items()) + "}"
        for name, dims in axes.items()
    )
    return (
        f"axes {keep} and {drop} have one size in every row of {source} ({sizes[0][keep]}): if they must be equal, "
        f"give them one name, signature.dynamic_axes: {{{declared}}}; else "
    )


def _sizes_hint(
    point: Mapping[str, int],
    own: Mapping[str, int],
    listed: Mapping[str, list[int]],
    direct: bool = False,
    uncut: Mapping[str, list[int]] | None = None,
    split_has: bool = False,
) -> str:
    """What to do about a size the model fails at: Kiln made a smaller one by cutting the data's rows (which drops
    what the rest of a row needs: a sequence's end-of-text token, nodes a graph's edges still index),
    ``signature.shapes`` lists one (``listed``) the model does not take, or the model takes one size only.
    ``direct``: ``kiln export -o``, whose rows are its example's, and whose fix suggests no list of the example's
    sizes alone, which would check no other size. ``uncut``: sizes Kiln makes from the held-out rows without cutting
    them that the model takes (:func:`_uncut_sizes`), suggested in place of the rows' own alone, which would lock
    the engine to one size; ``split_has``: the training split's rows have the size cut to, which is where that size
    came from. A listed size below the rows' own is one Kiln cut them to as well, so it counts as cut: the model may
    take it on whole rows of that size (a graph of that many nodes), which the cut rows are not. A suggested
    ``signature.shapes`` holds the axes in question alone (those at a size other than the rows' own): pinning an
    axis that varies fine would take its other sizes out of validation for nothing."""
    cut = {k: own[k] for k, v in point.items() if k in own and v < own[k]}
    given = ", ".join(f"{k}={v}" for k, v in point.items() if v in listed.get(k, ()) and v > own.get(k, v))
    moved = [k for k, v in point.items() if v != own.get(k, v)] or list(point)
    example = "{" + ", ".join(f"{k}: [{own.get(k, point[k])}]" for k in moved) + "}"
    if cut:
        return _cut_hint(point, cut, example, direct, uncut, split_has)
    listing = "signature.shapes" if direct else f"signature.shapes, e.g. {example}"
    if given:
        return (
            f"signature.shapes lists {given}: list there only sizes the model takes, or remove that axis from "
            "signature.dynamic_axes if it takes one size"
        )
    return "if the model takes one size, remove that axis from signature.dynamic_axes; else list sizes it takes in " + (
        listing
    )


def _cut_hint(
    point: Mapping[str, int],
    cut: Mapping[str, int],
    example: str,
    direct: bool,
    uncut: Mapping[str, list[int]] | None,
    split_has: bool,
) -> str:
    """:func:`_sizes_hint` where Kiln cut the rows (``cut``: their own size of each axis it cut): whose rows have
    the size, and sizes to validate at that need no cutting (``uncut``'s of the cut axes where given, else the rows'
    own, ``example``). Where the training split's rows have the size (``split_has``), the model takes it, so the
    cutting is the cause."""
    sizes = ", ".join(f"{k}={v}" for k, v in cut.items())
    if direct:
        fix = "list sizes it takes in signature.shapes"
    elif uncut:
        listed = "{" + ", ".join(f"{k}: {v}" for k, v in uncut.items() if k in cut) + "}"
        fix = (
            "validate at the held-out rows' own size and a larger one Kiln makes by repeating them, which the model "
            f"runs at, signature.shapes: {listed}"
        )
    else:
        fix = f"validate at sizes the data has, signature.shapes: {example}"
    if not split_has:
        return (
            f"Kiln made that size by cutting {rows_source(direct)}'s rows (its own: {sizes}), which drops what the "
            "rest of a row needs (a sequence's end token, nodes a graph's edges still index) or gives a size the "
            f"model's strides or pooling do not divide: {fix}; or remove the axis from signature.dynamic_axes if the "
            "model takes one size"
        )
    at = ", ".join(f"{k}={point[k]}" for k in cut)
    return (
        f"{at} is the training split's rows' size, but the later stages make every size from the held-out rows: "
        f"Kiln cut those (their own: {sizes}) to it, which drops what the rest of a row needs (a sequence's end "
        f"token, nodes a graph's edges still index): {fix}; or hold out rows of the smallest size, which Kiln only "
        "lengthens"
    )


def _uncut_sizes(
    model: nn.Module, like: Inputs, feed: Feed, axes: Axes, own: Mapping[str, int]
) -> dict[str, list[int]]:
    """Each axis's size in the held-out rows ``feed`` and twice it: sizes Kiln makes from them without cutting
    (:func:`kiln.core.shapes.resize` lengthens by repeating or padding), where PyTorch answers something finite at
    every shape the later stages run over them (:func:`kiln.core.shapes.shape_points`), their floats padded with
    zeros (as the export checks) and repeated (as validation and calibration grow them); empty where it does not,
    or the rows have no size on an axis."""
    sizes = {k: [v, 2 * v] for k, v in sorted(own.items()) if v > 0}
    if not sizes or len(sizes) < len(own):
        return {}
    row = {k: v[:1] for k, v in feed.items()}
    for point in shape_points(sizes):
        for repeat in (False, True):
            try:
                with warnings.catch_warnings():  # what the model warns of at a size only probed is not the user's
                    warnings.simplefilter("ignore")
                    ref = torch_outputs(model, from_feed(resize(row, axes, point, repeat_floats=repeat), like))
            except Exception:  # noqa: BLE001 - the model cannot take that size: suggest none of these
                return {}
            if nothing_finite(ref):
                return {}
    return sizes


def _uncut_if_cut(
    model: nn.Module, like: Inputs, point: Mapping[str, int], feeds: list[Feed], axes: Axes, direct: bool
) -> tuple[dict[str, list[int]], bool]:
    """For :func:`_sizes_hint` in a run (not ``direct``) where Kiln cut the held-out rows (``feeds[0]``) to reach
    ``point``: the sizes it makes from them uncut that the model takes (:func:`_uncut_sizes`), and whether another
    split's row (``feeds[1:]``) has ``point``'s sizes (:func:`_split_has`). Nothing is run otherwise."""
    own = own_sizes(feeds[0], axes)
    if direct or not any(v < own.get(k, v) for k, v in point.items()):
        return {}, False
    return _uncut_sizes(model, like, feeds[0], axes, own), _split_has(point, own, feeds[1:], axes)


def _split_has(point: Mapping[str, int], own: Mapping[str, int], seen: list[Feed], axes: Axes) -> bool:
    """Whether a row of another split than the held-out rows (``own``: their sizes; ``seen``: a row of each split)
    has every size of ``point`` that Kiln made by cutting those."""
    cut = {k: v for k, v in point.items() if k in own and v < own[k]}
    return bool(cut) and any(all(own_sizes(f, axes).get(k) == v for k, v in cut.items()) for f in seen)


def rows_source(direct: bool) -> str:
    """What the rows the size checks resize are, in words: the data's, or ``kiln export -o``'s example."""
    return "the example" if direct else "the data"


def direct_point(
    model: nn.Module, like: Inputs, feed: Feed, axes: Axes, point: Mapping[str, int], listed: Mapping[str, list[int]]
) -> dict[str, int] | None:
    """The sizes ``kiln export -o`` checks for ``point``. A size Kiln made there (half the example's, not one
    ``signature.shapes`` lists) where PyTorch fails, or answers nothing finite, on a row of ``feed`` says nothing of
    the graph: it gives way to the smallest size from it up that PyTorch takes (a convolution of kernel 7 without
    padding takes 7 and more), or, where none below the example's does, to the example's own, which the parity
    check ran; said in the log either way. None where no axis then differs from the example's."""
    own = own_sizes(feed, axes)
    made = [k for k, v in point.items() if k in own and v < own[k] and v not in listed.get(k, ())]
    why = _why_not_at(model, {k: v[:1] for k, v in feed.items()}, like, axes)
    reason = why(point) if made else ""
    if not reason:
        return dict(point)
    moved, base = dict(point), {**point, **{k: own[k] for k in made}}
    for label in made:
        sizes = range(point[label], own[label])
        moved[label] = next((s for s in sizes if not why({**base, label: s})), own[label])
        _say_moved(label, point[label], moved[label], own[label], reason)
    return None if all(v == own.get(k, v) for k, v in moved.items()) else moved


def _say_moved(label: str, made: int, size: int, own: int, reason: str) -> None:
    """The log line of :func:`direct_point` for one axis: the size checked in place of the one Kiln made."""
    if size == made:
        return
    if size < own:
        log.info(
            "signature axis %s: the smallest size from %d the model takes is %d (at %d: %s): the graph is checked "
            "at %s=%d in place of %d",
            *(label, made, size, made, reason, label, size, made),
        )
        return
    log.warning(
        "signature axis %s: the model takes no size from %d up to the example's, %d (at %d: %s): the graph is "
        "checked at %s=%d alone; list in signature.shapes larger sizes it takes to check it there",
        *(label, made, own, made, reason, label, own),
    )


def _why_not_at(model: nn.Module, feed: Feed, like: Inputs, axes: Axes) -> Callable[[Mapping[str, int]], str]:
    """Why PyTorch's ``model`` on ``feed`` (rebuilt as ``like``) resized to a point leaves nothing to compare
    there: its error, or an output NaN or infinite at every value; empty where it does not. Each point asked
    once."""

    @cache
    def why(point: tuple[tuple[str, int], ...]) -> str:
        try:
            with warnings.catch_warnings():  # what the model warns of at a size only probed is not the user's run's
                warnings.simplefilter("ignore")
                ref = torch_outputs(model, from_feed(resize(feed, axes, dict(point)), like))
        except Exception as exc:  # the model cannot take that size
            return error_reason(exc)
        empty = nothing_finite(ref)
        return f"output '{empty[0]}' is NaN or infinite at every value" if empty else ""

    return lambda point: why(tuple(sorted(point.items())))


def torch_at(
    model: nn.Module,
    inputs: Inputs,
    point: Mapping[str, int],
    feeds: list[Feed],
    axes: Axes,
    listed: Mapping[str, list[int]],
    direct: bool = False,
    own_rows: OwnRows | None = None,
) -> dict[str, np.ndarray]:
    """PyTorch's outputs at ``point`` (``feeds``: the data's, first the rows resized; ``listed``: the sizes
    ``signature.shapes`` gives; ``direct``: ``kiln export -o``'s example, not data; ``own_rows``: the size check's,
    shared by its sizes, so each size does not run the model at the rows' own sizes again); an error naming the size and
    what to change where the model itself fails there (:func:`_fails_at`), or where an output of it holds no finite
    value there (:func:`_nothing_finite_error`; :func:`_padded_to_nothing` where Kiln's zero padding gives that), or
    where it folds the axis into the batch (:func:`_folded_rows`)."""
    own = own_sizes(feeds[0], axes)
    try:
        ref = torch_outputs(model, inputs)
    except Exception as exc:
        raise _fails_at(model, inputs, point, feeds, axes, listed, direct, error_reason(exc)) from None
    empty = nothing_finite(ref)
    if empty and _zeros_give_it(model, inputs, point, feeds[0], axes):
        raise _padded_to_nothing(empty[0], point, own, direct)
    if empty:
        raise _nothing_finite_error(empty[0], point, own, listed, direct)
    folded = _folded_rows(model, inputs, ref, point, feeds[0], axes, own_rows or OwnRows())
    if folded is not None:
        raise folded
    return ref


def _rows_of_one(model: nn.Module, like: Inputs, row: Feed, axes: Axes, point: Mapping[str, int]) -> dict[str, int]:
    """The rows of each output of PyTorch's ``model`` on one sample, ``row`` resized to ``point``; empty where it
    fails there."""
    try:
        with warnings.catch_warnings():  # what the model warns of at a size only probed is not the user's run's
            warnings.simplefilter("ignore")
            out = torch_outputs(model, from_feed(resize(row, axes, point), like))
    except Exception:  # noqa: BLE001 - a size the model cannot take says nothing of its rows here
        return {}
    return {k: v.shape[0] for k, v in out.items() if v.ndim}


class OwnRows:
    """The rows of each output of PyTorch's model at the rows' own sizes, on all the rows and on one sample: the
    same at every size a check runs, so run once a check, and only where a size first needs them."""

    def __init__(self) -> None:
        self._rows: tuple[dict[str, int], dict[str, int]] | None = None

    def of(self, model: nn.Module, like: Inputs, feed: Feed, axes: Axes) -> tuple[dict[str, int], dict[str, int]]:
        """The rows of each output on ``feed`` and on its first sample, at their own sizes."""
        if self._rows is None:
            own, row = own_sizes(feed, axes), {k: v[:1] for k, v in feed.items()}
            self._rows = _rows_of_one(model, like, feed, axes, own), _rows_of_one(model, like, row, axes, own)
        return self._rows


def _folded_rows(
    model: nn.Module,
    like: Inputs,
    ref: Mapping[str, np.ndarray],
    point: Mapping[str, int],
    feed: Feed,
    axes: Axes,
    own_rows: OwnRows,
) -> ModelError | None:
    """The error where an output of PyTorch's at ``point`` (``ref``, on the rows ``feed`` resized) has another
    number of rows than the inputs have samples, and more than one for one sample there, while at the rows' own
    sizes it has one row a sample, on them and on one sample alone (``own_rows``): its axis 0 is the batch, and the
    model folds the varied axis into it (a pool sized to the data's length, then ``view(-1, C)``), which every gate
    would pass, the graph computing the same wrong rows. Outputs whose length the values decide (NMS) seldom keep
    one row a sample at two counts; None where none is. The one-sample run at ``point`` goes first: it alone clears
    most such outputs."""
    samples = len(next(iter(feed.values()))) if feed else 0
    odd = [k for k, v in ref.items() if v.ndim and v.shape[0] != samples]
    if not odd:
        return None
    at_point = _rows_of_one(model, like, {k: v[:1] for k, v in feed.items()}, axes, point)
    odd = [k for k in odd if at_point.get(k, 1) > 1]
    if not odd:
        return None
    whole, one = own_rows.of(model, like, feed, axes)
    for name in odd:
        if whole.get(name) == samples and one.get(name) == 1:
            return _folded_error(name, at_point[name], point, own_sizes(feed, axes))
    return None


def _folded_error(name: str, rows: int, point: Mapping[str, int], own: Mapping[str, int]) -> ModelError:
    """:func:`_folded_rows`'s error: output ``name`` has ``rows`` rows for one sample at ``point``, one at the rows'
    own sizes (``own``)."""
    moved = [k for k, v in point.items() if v != own.get(k, v)] or list(point)
    at = ", ".join(f"{k}={point[k]}" for k in moved)
    there = ", ".join(f"{k}={own[k]}" for k in moved if k in own)
    labels = " and ".join(moved)
    return ModelError(
        f"output '{name}' has {rows} rows for 1 sample at {at} (1 at {there}): the model folds {labels} into the "
        "batch axis, so its answers at other sizes are not one row a sample",
        hint="keep the batch axis apart: a pool sized to the data's length followed by view(-1, C) makes a row of "
        "each further window; flatten with x.view(x.size(0), -1), or pool over the whole axis, torch.amax(x, dim=2) "
        f"or nn.AdaptiveMaxPool1d(1); or remove {labels} from signature.dynamic_axes if the model takes one size",
    )


def _fails_at(
    model: nn.Module,
    inputs: Inputs,
    point: Mapping[str, int],
    feeds: list[Feed],
    axes: Axes,
    listed: Mapping[str, list[int]],
    direct: bool,
    reason: str,
) -> ModelError:
    """:func:`torch_at`'s error where PyTorch fails at ``point`` (``reason``: why). The fix is the first that
    explains it: a size off the model's steps, axes one name should tie or an input that should follow the axis, an
    axis the model fixes (:func:`_fixed_axis`), else what to do about the size (:func:`_sizes_hint`)."""
    at = ", ".join(f"{k}={v}" for k, v in point.items())
    runs = "a size the export checks" if direct else "a size the later stages run it at"
    message = f"the model fails at {at}, {runs} since signature.dynamic_axes makes that axis vary: {reason}"
    steps = _steps_hint(model, inputs, point, feeds[0], axes, listed)
    if steps:
        return ModelError(message, hint=steps)
    source = rows_source(direct)
    tie = one_name_hint(feeds, axes, point, source) + _untied_hint(feeds[0], axes, point, source)
    fixed = None if tie else _fixed_axis(model, inputs, point, feeds, axes)
    own = own_sizes(feeds[0], axes)
    blamed = "" if fixed else _listed_at_fault(model, inputs, point, feeds[0], axes, listed)
    if blamed:
        return ModelError(message, hint=tie + blamed)
    smallest = "" if tie or fixed else _smallest_hint(model, inputs, point, feeds[0], axes, listed)
    if smallest:
        return ModelError(message, hint=smallest)
    if fixed is None:
        uncut = _uncut_if_cut(model, inputs, point, feeds, axes, direct)
        return ModelError(message, hint=tie + _sizes_hint(point, own, listed, direct, *uncut))
    label, tried = fixed
    offset = _offset_tied(model, inputs, feeds[0], axes, label, tried)
    if offset is not None:
        return _offset_tie_error(message, label, *offset, own)
    return _fixed_axis_error(message, label, own[label], tried, feeds[0], axes, source)


def _listed_at_fault(
    model: nn.Module, like: Inputs, point: Mapping[str, int], feed: Feed, axes: Axes, listed: Mapping[str, list[int]]
) -> str:
    """The fix where ``point`` holds both a size Kiln made by cutting the rows of ``feed`` and one ``signature.shapes``
    lists (``listed``), and PyTorch still fails with the cut axes at the rows' own sizes: the listed size is the
    cause, not the cutting (a position table shorter than a listed length). Each listed size is named with the
    nearest one the model runs at, probed from the rows' own size as ``kiln build`` probes its ranges; empty where
    the point holds no such pair or the model runs once the cut axes are whole."""
    own = own_sizes(feed, axes)
    cut = {k: own[k] for k, v in point.items() if k in own and v < own[k] and v not in listed.get(k, ())}
    given = {k: v for k, v in point.items() if k in own and v in listed.get(k, ()) and v != own[k]}
    row = {k: v[:1] for k, v in feed.items()}
    if not cut or not given or not _why_not_at(model, row, like, axes)({**point, **cut}):
        return ""
    whole = {**point, **cut, **{k: own[k] for k in given}}
    said = []
    for label, size in given.items():
        near = _nearest_running(runs_at(model, row, like, axes, whole, label), own[label], size)
        edge = "largest" if size > own[label] else "smallest"
        said.append(f"{label}={size}" + (f" (the {edge} size it runs at there is {near})" if near else ""))
    return (
        f"signature.shapes lists {', '.join(said)}, where the model fails with the other axes at the data's own "
        "sizes: list there only sizes the model takes, or remove that axis from signature.dynamic_axes if it takes "
        "one size"
    )


def _smallest_hint(
    model: nn.Module, like: Inputs, point: Mapping[str, int], feed: Feed, axes: Axes, listed: Mapping[str, list[int]]
) -> str:
    """The fix where each size of ``point`` below the rows' own (those of ``feed``) is one ``signature.shapes``
    lists (``listed``), and the model, the other axes at the rows' own sizes, fails there but takes every size from
    a smallest up to the rows' own (a convolution stack wider than a short input): the listed range starts at that
    smallest, its maximum kept, so lengths between it and the rows' own stay served. Empty where no such smallest
    lies below the rows' own (cutting the rows drops what a row needs) or the model fails at a size probed above it
    (steps, not a minimum), which the other hints speak of."""
    own = own_sizes(feed, axes)
    low = {k: v for k, v in point.items() if k in own and v < own[k]}
    if not low or any(v not in listed.get(k, ()) for k, v in low.items()):
        return ""
    why = _why_not_at(model, {k: v[:1] for k, v in feed.items()}, like, axes)
    said, shapes = [], {k: sorted(v) for k, v in listed.items()}
    for label, size in low.items():
        reason = why({**own, label: size})
        smallest = _smallest_running(lambda s, lbl=label: not why({**own, lbl: s}), size, own[label], listed[label])
        if not reason or smallest is None:
            return ""
        said.append(f"the model takes {label} from {smallest} up (at {size}: {reason})")
        shapes[label] = sorted({max(s, smallest) for s in listed[label]})
    shown = "{" + ", ".join(f"{k}: {v}" for k, v in shapes.items()) + "}"
    return f"{'; '.join(said)}: signature.shapes: {shown}"


def _smallest_running(runs: Callable[[int], bool], size: int, own: int, listed: list[int]) -> int | None:
    """The smallest size from ``size`` (where the model fails) up to ``own`` (where it runs) that ``runs``, found by
    bisection (about log2 of the gap runs), where the model also runs at the two sizes after it and at each of
    ``listed`` between it and ``own``, as a model with a smallest size does; None where it fails at one of those
    (its sizes go in steps, not from a smallest up) or runs at no size below ``own``."""
    found = _nearest_running(runs, own, size)
    if found is None or found >= own:
        return None
    above = {s for s in (found + 1, found + 2, *listed) if found < s <= own}
    return found if all(runs(s) for s in sorted(above)) else None


def _nearest_running(runs: Callable[[int], bool], own: int, size: int) -> int | None:
    """The size nearest ``size`` on the way from ``own`` (the rows' own, which the model runs at) that ``runs``, by
    bisection, as sizes a model takes up to a largest (a position table) or from a smallest (a kernel) run; None
    where it does not run at ``own`` either."""
    if not runs(own):
        return None
    good, bad = own, size  # runs at good, fails at bad
    while abs(bad - good) > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if runs(mid) else (good, mid)
    return good


def _fixed_axis(
    model: nn.Module,
    like: Inputs,
    point: Mapping[str, int],
    feeds: list[Feed],
    axes: Axes,
) -> tuple[str, list[int]] | None:
    """An axis of ``point`` at another size than the data's, one Kiln made or one ``signature.shapes`` lists, that
    the model itself fixes, with the sizes it was tried at: the data (every one of ``feeds``) has one size there,
    and PyTorch, the other axes at the data's sizes, runs at it but not at ``point``'s, one more, twice it or, where
    ``point``'s is larger, one less (a channel axis named as frames takes 3 alone, a cloud's xyz axis named as its
    points); None where none is. A listed size is then not at fault: no size but the data's would run. A model that
    fails only at a size Kiln cut (a sequence's end token dropped) runs at one of the larger ones, and one of a
    largest size (a position table sliced to the length) at the smaller."""
    own = own_sizes(feeds[0], axes)
    row = {k: v[:1] for k, v in feeds[0].items()}
    for label, size in point.items():
        if label not in own or size == own[label]:
            continue
        if any(own_sizes(f, axes).get(label) != own[label] for f in feeds):
            continue
        runs = runs_at(model, row, like, axes, own, label)
        below = size if size < own[label] else own[label] - 1  # a model of a largest size runs below it
        tried = sorted({s for s in (below, size, own[label] + 1, 2 * own[label]) if s >= 1})
        if runs(own[label]) and not any(runs(s) for s in tried):
            return label, tried
    return None


def _offset_tied(
    model: nn.Module, like: Inputs, feed: Feed, axes: Axes, label: str, tried: list[int]
) -> tuple[str, int] | None:
    """Another named axis that PyTorch runs with where ``label`` alone fails at a size of ``tried``, moved by the
    same amount (the sizes' gap in ``feed``, the data's rows, kept): a KV-cache step's mask of ``total = past + 1``
    columns beside caches of ``past`` steps. The model then takes other sizes, tied by an offset, which Kiln's
    sizing of each named axis on its own cannot keep: (that axis's name, its size minus ``label``'s in the data)."""
    own = own_sizes(feed, axes)
    why = _why_not_at(model, {k: v[:1] for k, v in feed.items()}, like, axes)
    for other in (k for k in own if k != label):
        gap = own[other] - own[label]
        if any(s + gap >= 1 and not why({**own, label: s, other: s + gap}) for s in tried):
            return other, gap
    return None


def _offset_tie_error(message: str, label: str, other: str, gap: int, own: Mapping[str, int]) -> ModelError:
    """The error where the model runs with axes ``label`` and ``other`` moved together, ``other`` ``gap`` longer in
    the data (``own``: its sizes), but not with ``label`` alone (:func:`_offset_tied`): Kiln sizes each named axis
    on its own, so the fix makes the inputs' lengths equal and gives them one name."""
    long, short = (other, label) if gap > 0 else (label, other)
    tied = f"{long} = {short} + {abs(gap)}" if gap else f"{long} = {short}"
    return ModelError(
        f"{message}; the model runs with axes {label} and {other} moved together ({tied}, as in the data's "
        f"{long}={own[long]}, {short}={own[short]}), not with one alone: they are tied by an offset, and Kiln sizes "
        "each named axis on its own",
        hint=f"give the inputs of {long} the length of {short} and one name for both, {short}, in "
        f"signature.dynamic_axes: where the {abs(gap)} more are the new token's (a KV-cache step's attention mask), "
        "pass the mask of the past alone and append the new token's column inside forward (torch.cat([mask, "
        "torch.ones_like(input_ids)], dim=1))"
        if gap
        else f"give axes {label} and {other} one name in signature.dynamic_axes",
    )


def _fixed_axis_error(
    message: str, label: str, size: int, tried: list[int], feed: Feed, axes: Axes, source: str
) -> ModelError:
    """The error where the model fixes the axes named ``label`` at ``size`` (:func:`_fixed_axis`; ``tried``: the
    sizes it fails at): the fix is removing them from ``signature.dynamic_axes``, and naming the axis that varies
    if another does (``feed``: ``source``'s rows, whose sample shapes it shows). The probe showed the model itself
    fails at every other size, so no list of sizes to validate at is offered: one would send the export on to fail
    again where the model pins the axis."""
    where = [(name, int(axis)) for name, dims in axes.items() for axis, lbl in dims.items() if lbl == label]
    places = " and ".join(f"axis {axis} of '{name}'" for name, axis in where)
    failed = ", ".join(map(str, tried[:-1])) + f" or {tried[-1]}" if len(tried) > 1 else str(tried[0])
    shown = ", ".join(f"'{name}' {list(feed[name].shape[1:])}" for name in dict.fromkeys(n for n, _ in where))
    axis_word = "axis" if len(where) == 1 else "axes"
    return ModelError(
        f"{message}; the model fixes {places} ({label}): it runs at {source}'s {size} alone there, not at {failed}",
        hint=f"remove the {axis_word} from signature.dynamic_axes ({places}: the model takes only {size} there); if "
        f"another axis varies, name that one instead (samples in {source}: {shown})",
    )


def _nothing_finite_error(
    name: str, point: Mapping[str, int], own: Mapping[str, int], listed: Mapping[str, list[int]], direct: bool
) -> ModelError:
    """The ModelError where output ``name`` of PyTorch's is nowhere finite at ``point``: at a size the later stages
    run, the engines would answer NaN there and the size be recorded as validated. The sizes the fix suggests are
    ``listed`` (``signature.shapes``) and the data's (``own``), the failing one left out of the axes that differ
    from the data's (those at fault) only. ``direct``: ``kiln export -o``, whose fix suggests no list of the
    example's sizes alone, which would check no other size."""
    at = ", ".join(f"{k}={v}" for k, v in point.items())
    keep = {
        k: sorted({*listed.get(k, []), own.get(k, v)} - ({v} if v != own.get(k, v) else set()))
        for k, v in point.items()
    }
    sizes = "{" + ", ".join(f"{k}: {v}" for k, v in keep.items()) + "}"
    if not direct:
        first = f"validate at sizes it takes, signature.shapes: {sizes}"
    elif any(s != own.get(k) for k, v in keep.items() for s in v):
        first = f"list sizes where it is finite in signature.shapes, e.g. {sizes}"
    else:
        first = "list sizes where it is finite in signature.shapes"
    return ModelError(
        f"the model's output '{name}' is NaN or infinite at every value at {at}: it overflows (or divides by "
        "zero) at this size, so nothing there can be compared",
        hint=f"{first}; or compute in a form that stays finite there (in log space, or with the running maximum "
        "subtracted before exp)",
    )


def _zeros_give_it(model: nn.Module, like: Inputs, point: Mapping[str, int], feed: Feed, axes: Axes) -> bool:
    """Whether ``feed`` reached ``point`` by padding its float inputs with zeros (:func:`kiln.core.shapes.resize`
    repeats a float input's values only when asked) and PyTorch, given those values repeated to the same sizes
    instead, answers a finite value in every output: then the zeros Kiln added, not the model, leave nothing
    finite there (0/0 where a row is normalised)."""
    padded, repeated = resize(feed, axes, point), resize(feed, axes, point, repeat_floats=True)
    if all(np.array_equal(padded[n], repeated[n]) for n in padded):
        return False
    try:
        return not nothing_finite(torch_outputs(model, from_feed(repeated, like)))
    except Exception:  # the model takes no repeated values either: not the padding's doing
        return False


def _padded_to_nothing(name: str, point: Mapping[str, int], own: Mapping[str, int], direct: bool) -> ModelError:
    """The ModelError where output ``name`` is nowhere finite at ``point`` on inputs Kiln lengthened with zeros
    only (:func:`_zeros_give_it`): the fix is inputs of that length, or sizes no longer than the rows' own."""
    at = ", ".join(f"{k}={v}" for k, v in point.items())
    grown = ", ".join(f"{k}={own[k]}" for k, v in point.items() if k in own and v > own[k])
    whose, inputs = ("the example's", "inputs") if direct else ("the data's", "data")
    return ModelError(
        f"the model's output '{name}' is NaN or infinite at every value at {at}, where Kiln lengthened {whose} "
        "rows by padding their float inputs with zeros; with their own values repeated to that length it is "
        "finite: the zeros Kiln added, not the model, leave nothing there to compare (0/0 where a row is normalised)",
        hint=f"give {inputs} whose rows have that length, or list in signature.shapes sizes no longer than "
        f"{whose} ({grown})",
    )


# Sizes past the data's own the step probe tries besides its first draw (:func:`first_probes`): a model that
# takes sizes in steps of one of these (strides and poolings: 2, 4, 8, ...; 3, 6, 12, ...) takes the data's size
# plus its step
_OWN_PLUS = (2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64)


def _steps_hint(
    model: nn.Module, like: Inputs, point: Mapping[str, int], feed: Feed, axes: Axes, listed: Mapping[str, list[int]]
) -> str:
    """The fix where PyTorch fails at ``point`` because a size there that ``signature.shapes`` lists (``listed``) is
    off the steps the model takes that axis in (a U-Net's odd height, which its pooling and upsampling cannot meet
    again): PyTorch runs on one row of ``feed`` at the sizes of the window :func:`size_steps` probes (two periods
    of :data:`MAX_PERIOD` from the smaller of that size and the data's), the other axes at the data's, and a period
    is said with the sizes nearest; empty where none explains it. Where a first sample shows no steps (the data's
    size alone runs, or every size from one on: :func:`_steps_may_show`), the window is not probed. Sizes Kiln
    made (half the data's) are left to the other hints."""
    own = own_sizes(feed, axes)
    one = {k: v[:1] for k, v in feed.items()}
    said = []
    for label, size in point.items():
        if size not in listed.get(label, ()) or label not in own:
            continue
        low = min(size, own[label])
        high = low + 2 * MAX_PERIOD
        runs = runs_at(model, one, like, axes, own, label)
        if not _steps_may_show(runs, [*first_probes(low, high), *(own[label] + p for p in _OWN_PLUS)], own[label]):
            continue
        pattern = size_pattern(runs, low, high, label)
        if pattern is None or 2 * pattern[0] > high - low + 1 or takes_size(pattern, size):
            continue
        period = pattern[0]
        near = [s for s in range(max(1, size - period), size) if takes_size(pattern, s)][-1:]
        near += [s for s in range(size + 1, size + period + 1) if takes_size(pattern, s)][:1]
        said.append(
            f"{label}={size} is not a size the model takes: it takes {label}{steps_text(pattern)} "
            f"({', '.join(map(str, near))}, ...)"
        )
    return "; ".join(said) + ": list such sizes in signature.shapes" if said else ""


def _steps_may_show(runs: Callable[[int], bool], sizes: list[int], own: int) -> bool:
    """Whether the sizes PyTorch runs at among ``sizes`` and the data's (``own``) may follow steps: it runs at one
    besides ``own``, and in size order they turn from running to failing, or back, more than once. A model that
    takes the data's size alone, every size from a smallest on (a kernel wider than shorter inputs) or up to a
    largest (a position table) shows no steps, and the step probe's hundred-odd runs are saved."""
    order = sorted({*sizes, own})
    ran = [runs(s) for s in order]
    flips = sum(a != b for a, b in zip(ran, ran[1:]))
    return flips > 1 and any(r for s, r in zip(order, ran) if s != own)
