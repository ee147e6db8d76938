"""The input shapes validation runs at: every dynamic axis besides batch (``signature.dynamic_axes``) at its
smallest and largest size (``signature.shapes``, or from the data), so an engine that is right at one
sequence length and wrong at another cannot pass."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING

import numpy as np

from kiln.core.errors import ConfigError
from kiln.core.labels import is_mask_name, is_padding_mask_name, left_padded, pad_positions, padding_value
from kiln.core.records import TensorSpec

if TYPE_CHECKING:  # kiln.core.data imports torch; the graph stages need none of it
    from kiln.core.data import Feed

Axes = Mapping[str, Mapping[int, str]]

log = logging.getLogger("kiln")
# (input, axis) pairs :func:`unnamed_lengths` has warned of: resize runs per batch and size, the warning once
_SAID_UNNAMED: set[tuple[str, str]] = set()

# How far each repeated copy of a float input moves from the one before it, as a share of the input's spread: far
# above float rounding, so a model's scores on a copy tie with none on the data (a detector's top-k peaks, which
# PyTorch and ONNX Runtime order apart where equal), and far below what changes what the input shows
COPY_STEP = 1e-3
# Each axis's copies move by COPY_STEP times 1 + axis * this: factors whose ratios are irrational, so no count of
# copies along one axis moves a value as far as a count along another (an image grown in both height and width
# holds no patch twice); the k-th copy's share of its step steps by this too (:func:`_copy_shares`)
_AXIS_FACTOR = (5**0.5 - 1) / 2


def graph_axes(specs: list[TensorSpec]) -> dict[str, dict[int, str]]:
    """The dynamic axes besides batch an ONNX graph declares (symbolic dims), as ``signature.dynamic_axes``."""
    out = {s.name: {i: d for i, d in enumerate(s.shape) if i > 0 and isinstance(d, str) and d} for s in specs}
    return {k: v for k, v in out.items() if v}


def graph_axes_with(configured: Axes | None, specs: list[TensorSpec]) -> Axes:
    """The graph's own dynamic axes besides batch (:func:`graph_axes`) with ``configured``
    (``signature.dynamic_axes``) laid over them axis by axis: a user who names one axis the file left unnamed
    keeps the names the file gives the rest."""
    merged = {name: dict(dims) for name, dims in graph_axes(specs).items()}
    for name, dims in (configured or {}).items():
        merged.setdefault(name, {}).update(dims)
    return merged


def axis_names(specs: list[TensorSpec]) -> list[str]:
    """The names of the dynamic axes besides batch an ONNX graph declares (:func:`graph_axes`), sorted."""
    return sorted({d for axes in graph_axes(specs).values() for d in axes.values()})


def shapes_flag(names: list[str]) -> str:
    """The ``--set`` that gives sizes to the dynamic axes ``names`` (``signature.shapes``), for a fix line: a graph
    stage run on a file has no data to take them from."""
    return "--set 'signature.shapes={" + ", ".join(f"{n}: [MIN, MAX]" for n in names) + "}'"


def refuse_unknown_axes(shapes: Iterable[str], names: list[str]) -> None:
    """``signature.shapes`` keyed by axes the graph has (``names``: its dynamic axes besides batch), or one error
    listing them, with the flag to give."""
    unknown = sorted(set(shapes) - set(names))
    if unknown:
        raise ConfigError(
            f"signature.shapes names axes {unknown}; the graph's dynamic axes besides batch are {names or 'none'}",
            hint="key signature.shapes by the names the graph gives its axes"
            + (f": {shapes_flag(names)}" if names else " (or leave it out)"),
        )


def axis_sizes(feeds: list[Feed], axes: Axes, configured: Mapping[str, list[int]]) -> dict[str, list[int]]:
    """Dynamic axis name -> sizes to validate at: ``configured`` where given, else the smallest and largest
    size of the axis over ``feeds`` (the splits); a single size ``L`` in the data gives ``L // 2`` and ``L``. An
    input that looks like each row's length along an axis but is not named like one is warned of
    (:func:`_say_unnamed_lengths`): resizing leaves it as it is."""
    names = sorted({d for a in axes.values() for d in a.values()} - {"batch"})
    unknown = sorted(set(configured) - set(names))
    if unknown:
        raise ConfigError(
            f"signature.shapes names axes {unknown}; signature.dynamic_axes declares {names or 'none'}",
            hint=_undeclared_hint(unknown, names),
        )
    sizes: dict[str, list[int]] = {}
    for name in names:
        if name in configured:
            sizes[name] = sorted(set(configured[name]))
            continue
        seen = {
            f[i].shape[int(ax)] for f in feeds for i, a in axes.items() if i in f for ax, d in a.items() if d == name
        }
        sizes[name] = two_sizes(min(seen), max(seen))
    _say_unnamed_lengths(feeds, axes, sizes)
    return sizes


def _undeclared_hint(unknown: list[str], names: list[str]) -> str:
    """The fix where signature.shapes names axes ``unknown`` that signature.dynamic_axes does not declare (``names``:
    those it does): keyed by a declared name, as in the example; where it declares none, the axis declared there
    (the graph is then exported with it dynamic) or the sizes left out."""
    if names:
        return f"key signature.shapes by the axis names of signature.dynamic_axes, e.g. {{{names[0]}: [8, 32]}}"
    return (
        f"declare {', '.join(unknown)} in signature.dynamic_axes, by input and axis (e.g. {{input_ids: {{1: "
        f"{unknown[0]}}}}}), and export again; or leave signature.shapes out"
    )


def two_sizes(lo: int, hi: int) -> list[int]:
    """The sizes to check an axis at, from the smallest and largest in the data: those two, or with one size ``L``
    in the data ``L // 2`` and ``L`` (a length baked into a graph shows at one of them)."""
    return sorted({max(1, hi // 2), hi} if lo == hi else {lo, hi})


def shape_points(sizes: dict[str, list[int]]) -> list[dict[str, int]]:
    """The smallest sizes of every axis together, ..., the largest together; with several axes, also each axis at its
    smallest while the others are at their largest (a decode step's one new token beside a long cache; a tall,
    narrow image), before the largest: an engine records every axis's range as validated, so the ranges' corners
    are run, not every combination. The largest together stays last."""
    if not sizes:
        return [{}]
    count = max(len(v) for v in sizes.values())
    points = [{n: v[min(i, len(v) - 1)] for n, v in sizes.items()} for i in range(count)]
    if len(sizes) > 1:
        corners = [{n: (min(v) if n == axis else max(v)) for n, v in sizes.items()} for axis in sizes]
        points[-1:-1] = [c for i, c in enumerate(corners) if c not in points and c not in corners[:i]]
    return points


def resize(
    feed: Feed,
    axes: Axes,
    point: Mapping[str, int],
    fill: int = 0,
    repeat_floats: bool = False,
    left: AbstractSet[str] | None = None,
    step_sign: int = 1,
) -> Feed:
    """``feed`` with each dynamic axis cut or lengthened to its size in ``point``, every input on one axis alike, so
    that token ids, their attention mask and labels per token resized by the same ``axes`` stay paired.

    Lengthened by repeating the data's own values along the axis: token ids and their mask tiled together, so the
    new positions hold tokens as real as the data's and the comparisons read them (a mask lengthened with 0s would
    mark them padding, which the comparisons leave out); where the mask shows rows padded at their end, each row
    repeats its real positions only (:func:`_tiled_rows`), so no padding lands mid-row. A float input repeats
    only with ``repeat_floats`` (a clip played again, a cloud's points repeated: where zeros would be silence or
    points at the origin), each copy shifted by its own share, at most one, of a step of its spread (:func:`copy_step`,
    :func:`_copy_shares`: the first copy by the whole step, none further, however many copies), up (``step_sign``
    1) or down (-1), so the model's scores on a copy tie with none on the data: runtimes order equal scores apart
    (top-k, argmax), which would fail a right graph; integers, and floats that are flags (one named like a mask, or
    of two values at most: a 0/1 or 0/-inf mask, one-hot rows), repeat exactly. Without it, an
    axis that holds one is padded, every input on it: an integer one with the value its data holds where its
    attention mask marks padding (:func:`kiln.core.labels.padding_value`: the pad token, a mask's 0, a padding
    mask's True), else ``fill``. Cut by keeping the first positions, or the last on the axes ``left`` names (None:
    those whose attention or padding mask shows left padding, :func:`kiln.core.labels.left_padded`), where
    left-padded rows hold their real tokens.
    An input that holds each row's length along an axis (:func:`length_inputs`) says where the row's padding
    starts where no mask does, and is resized with the axis so the two agree (:func:`_resized_lengths`)."""
    left = left_padded(feed, axes) if left is None else left
    out = {name: np.asarray(array) for name, array in feed.items()}
    # a padding mask (True marks padding) with no padding in the data pads with True, as an attention mask with 0
    fills = {name: padding_value(feed, name) for name in feed}
    fills |= {name: 1 for name, value in fills.items() if value is None and is_padding_mask_name(name)}
    measures = length_inputs(out, axes, point)
    for label, size in point.items():
        on = [(n, int(i)) for n, dims in axes.items() if n in out for i, d in dims.items() if d == label]
        lengths = [n for n, measured in measures.items() if measured == label]
        have = out[on[0][0]].shape[on[0][1]] if on else 0
        tile = all(out[n].shape[i] and (repeat_floats or out[n].dtype.kind != "f") for n, i in on)
        real = _real_lengths(out, on, [out[n] for n in lengths]) if tile and label not in left else None
        for name, axis in on:
            own = fills[name]
            grows = tile and out[name].shape[axis] < size and not is_mask_name(name)
            step = step_sign * copy_step(out[name], axis) if grows else 0.0
            if real is not None and axis == 1 and out[name].shape[0] == len(real) and out[name].shape[1] < size:
                out[name] = _tiled_rows(out[name], real, size, step)
                continue
            out[name] = _resized(out[name], axis, size, tile, label in left, fill if own is None else own, step)
        for name in lengths:
            out[name] = _resized_lengths(out[name], have, size, tile, rows=real is not None)
    return {name: np.ascontiguousarray(array) for name, array in out.items()}


def is_length_name(name: str) -> bool:
    """Named like each row's length along an axis (``lengths``, ``seq_len``, ``input_lengths``, ``ilens``): the
    name ends in ``len``, ``lens``, ``length`` or ``lengths``."""
    return name.lower().endswith(("len", "lens", "length", "lengths"))


def length_inputs(feed: Feed, axes: Axes, point: Mapping[str, int]) -> dict[str, str]:
    """Input -> the dynamic axis (of those ``point`` sizes) it holds each row's length along, as
    ``pack_padded_sequence`` takes it: an integer ``[N]`` or ``[N, 1]`` input named like lengths
    (:func:`is_length_name`) and on no dynamic axis itself, whose values lie in 0..the axis's size for exactly one
    axis whose inputs have its ``N`` rows. Values that fit several axes, or none, say nothing of which they measure:
    such an input is left as it is."""
    found = {}
    for name, value in feed.items():
        value = np.asarray(value)
        if name in axes and axes[name] or not is_length_name(name) or value.dtype.kind not in "iu" or not value.size:
            continue
        if value.ndim != 1 and value.shape[1:] != (1,):
            continue
        fits = [label for label in point if _measures(feed, axes, label, value)]
        if len(fits) == 1:
            found[name] = fits[0]
    return found


def unnamed_lengths(feeds: list[Feed], axes: Axes, labels: Iterable[str]) -> dict[str, str]:
    """Input -> the dynamic axis (of ``labels``) it looks like it holds each row's length along, for an input
    :func:`length_inputs` does not take because of its name (``n_frames``): integer, one value per row (``[N]``), on
    no dynamic axis itself, in every feed (the data's splits) within 1..the axis's size for that one axis alone, and
    the axis's size in at least one row."""
    fits: dict[str, set[str]] = {}
    reached: set[str] = set()
    for feed in feeds:
        for name, value in feed.items():
            value = np.asarray(value)
            if name in axes and axes[name] or is_length_name(name) or value.dtype.kind not in "iu" or value.ndim != 1:
                continue
            ok = {label for label in labels if value.size and value.min() >= 1 and _measures(feed, axes, label, value)}
            fits[name] = fits.get(name, ok) & ok
            reached |= {name} if any(value.max() == _size(feed, axes, label) for label in ok) else set()
    return {name: next(iter(on)) for name, on in fits.items() if len(on) == 1 and name in reached}


def _size(feed: Feed, axes: Axes, label: str) -> int:
    """The size axis ``label`` has in ``feed`` (its first input on it)."""
    return next(
        np.shape(feed[n])[int(i)] for n, dims in axes.items() if n in feed for i, d in dims.items() if d == label
    )


def _say_unnamed_lengths(feeds: list[Feed], axes: Axes, sizes: Mapping[str, list[int]]) -> None:
    """Warn, once per input and axis, of an input that looks like each row's length along an axis validation resizes
    to ``sizes`` other than the data's (:func:`unnamed_lengths`) but is not named like one: it is left as it is, so
    its rows claim lengths the resized inputs do not have, and nothing else shows it."""
    for name, label in unnamed_lengths(feeds, axes, sizes).items():
        own = {_size(f, axes, label) for f in feeds if name in f}
        if set(sizes[label]) <= own or (name, label) in _SAID_UNNAMED:
            continue
        _SAID_UNNAMED.add((name, label))
        log.warning(
            "input '%s' holds one integer per row, up to %d (the data's size of the axis), like each row's length "
            "along axis %s, but is not named like lengths: validation resizes %s to %s and leaves it as it is, so "
            "rows claim lengths their inputs do not have; rename it to end in len, lens, length or lengths "
            "(docs/byom.md) for Kiln to resize it with the axis",
            name,
            max(own),
            label,
            label,
            sizes[label],
        )


def _measures(feed: Feed, axes: Axes, label: str, lengths: np.ndarray) -> bool:
    """Whether ``lengths`` can be each row's length along axis ``label``: the inputs on it have one size there and
    as many rows as ``lengths``, and every value lies within 0..that size."""
    on = [(np.shape(feed[n]), int(i)) for n, dims in axes.items() if n in feed for i, d in dims.items() if d == label]
    sizes, rows = {shape[i] for shape, i in on}, {shape[0] for shape, _ in on}
    return len(sizes) == 1 and rows == {len(lengths)} and 0 <= lengths.min() and lengths.max() <= sizes.pop()


def _resized_lengths(lengths: np.ndarray, have: int, size: int, tile: bool, rows: bool) -> np.ndarray:
    """Each row's length once its axis goes from ``have`` to ``size`` positions as :func:`resize` makes it: cut,
    at most ``size``; lengthened by repeating each row's real positions (``rows``, :func:`_tiled_rows`), ``size``
    (0 stays 0: a row of padding repeats padding); by repeating whole rows (``tile``), ``size`` for a row with no
    padding; padded at the end, unchanged."""
    if size <= have:
        return np.minimum(lengths, size)
    if rows:
        return np.where(lengths > 0, size, 0).astype(lengths.dtype)
    return np.where(lengths == have, size, lengths).astype(lengths.dtype) if tile else lengths


def _real_lengths(out: Feed, on: list[tuple[str, int]], lengths: list[np.ndarray]) -> np.ndarray | None:
    """Each row's count of real positions on an axis whose mask (axis 1 of an integer ``[N, seq]`` input named like an
    attention or padding mask, :func:`kiln.core.labels.pad_positions`) shows right padding: every row starts real, some
    end in padding; else the first of ``lengths`` (inputs that hold each row's length along it, :func:`length_inputs`).
    None where neither lies on it."""
    for name, axis in on:
        mask = out[name]
        if axis != 1 or not is_mask_name(name) or mask.ndim != 2 or mask.dtype.kind not in "iub" or not mask.size:
            continue
        real = ~pad_positions(name, mask)
        if real[:, 0].all() and not real[:, -1].all():
            return real.sum(1)
    return lengths[0].reshape(-1) if lengths else None


def copy_step(array: np.ndarray, axis: int) -> float:
    """How far :func:`resize` shifts the first repeated copy of ``array`` along ``axis`` from the data, and at most
    any later one (:func:`_copy_shares`): 0 for an integer or boolean array (token ids, masks: repeated exactly) and
    for a float one of two distinct finite values at most (a 0/1, 0/-inf or 0/-1e9 mask, one-hot rows: flags, which
    a shift would turn into values no client sends); for another float one :data:`COPY_STEP` times its spread (the
    standard deviation of its finite values), so zeros move too, times a factor of the axis (:data:`_AXIS_FACTOR`).
    """
    if array.dtype.kind != "f" or not array.size:
        return 0.0
    values = np.asarray(array, np.float64)
    values = values[np.isfinite(values)]
    if np.unique(values).size <= 2:
        return 0.0
    return COPY_STEP * float(values.std()) * (1.0 + axis * _AXIS_FACTOR)


def _copy_shares(copies: np.ndarray) -> np.ndarray:
    """The share of its step each copy is shifted by (``copies``: each position's copy number, 0 for the data's own):
    0 for the data, 1 for the first copy, and 1 - frac((k - 1) * :data:`_AXIS_FACTOR`) for the k-th, distinct for
    every k and within (0, 1], so the shift stays within a step however many copies a short input is grown by."""
    shares = 1.0 - np.modf(np.maximum(copies - 1, 0) * _AXIS_FACTOR)[0]
    return np.where(copies > 0, shares, 0.0)


def _shifted(array: np.ndarray, copies: np.ndarray, step: float) -> np.ndarray:
    """``array`` with each position moved by ``step`` times its copy's share (:func:`_copy_shares`; ``copies``: 0
    for the data's own positions, broadcast against ``array``), in its own dtype; as it is where ``step`` is 0."""
    return (array + _copy_shares(copies) * step).astype(array.dtype) if step else array


def _tiled_rows(array: np.ndarray, real: np.ndarray, size: int, step: float = 0.0) -> np.ndarray:
    """``array`` lengthened to ``size`` along axis 1, each row repeating its own ``real`` first positions: a clip
    padded at its end plays again from its start, its mask 1 throughout, where tiling the whole row would put its
    padding in the middle (a mask no client sends, which Wav2Vec2 reads as a shorter clip). Each copy is shifted by
    ``step`` from the one before (:func:`copy_step`)."""
    length = np.maximum(real, 1)[:, None]
    trailing = (1,) * (array.ndim - 2)
    index = np.arange(size)[None, :] % length
    tiled = np.take_along_axis(array, index.reshape(index.shape + trailing), axis=1)
    copies = np.arange(size)[None, :] // length
    return _shifted(tiled, copies.reshape(copies.shape + trailing), step)


def _resized(
    array: np.ndarray, axis: int, size: int, tile: bool, from_end: bool, fill: float, step: float = 0.0
) -> np.ndarray:
    """``array`` at ``size`` along ``axis``: its first positions, or its last (``from_end``); past its length its
    values repeated (``tile``), each copy shifted by ``step`` from the one before (:func:`copy_step`), or
    ``fill``."""
    have = array.shape[axis]
    if have >= size:
        return np.take(array, np.arange(have - size, have) if from_end else np.arange(size), axis=axis)
    if tile:
        copies = np.arange(size) // have
        shape = [1] * array.ndim
        shape[axis] = size
        return _shifted(np.take(array, np.arange(size) % have, axis=axis), copies.reshape(shape), step)
    pad = [(0, 0)] * array.ndim
    pad[axis] = (0, size - have)
    return np.pad(array, pad, constant_values=fill)
