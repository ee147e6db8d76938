"""Named input arrays a user hands Kiln in an ``.npz`` file (``--inputs``, ``--calibration``), read and checked
against the inputs a model or engine declares.

A graph that fixes its batch axis (the TorchScript exporter's batch 1, as most published files have it) takes its
rows one batch of that size at a time: read with ``batched=True``, a file of any whole number of such batches is
taken (a last partial batch is dropped, with a warning), and :func:`in_batches` and :func:`run_batched` feed it."""

from __future__ import annotations

import json
import keyword
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

from kiln.core.errors import InputFileError
from kiln.core.records import TensorSpec, fits, reordered
from kiln.core.shapes import is_length_name

log = logging.getLogger("kiln")
Arrays = dict[str, np.ndarray]


def read_feed(
    path: Path, specs: list[TensorSpec], taker: str = "the engine", batched: bool = False
) -> dict[str, np.ndarray]:
    """The arrays of an ``.npz`` keyed by the input names of ``taker`` (an engine's ``kiln-engine.json`` "inputs",
    or a model's graph inputs), checked against their declared dtypes and shapes, rows and values. ``batched``: the
    caller feeds a graph that fixes its batch axis (:func:`fixed_batch`) one batch at a time, so any whole number
    of its batches is taken (:func:`whole_batches`); otherwise rows past that batch are refused."""
    names = [s.name for s in specs]
    hint = f"give an .npz with one array per input: {_savez_call(names)}"
    if not path.is_file():
        raise InputFileError(f"inputs file not found: {path}", hint=hint)
    try:
        loaded = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        raise InputFileError(f"cannot read inputs {path}: {exc}", hint=hint) from None
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise InputFileError(f"{path} holds one bare array, not named arrays", hint=hint)
    with loaded:
        try:
            feed = dict(loaded)
        except ValueError as exc:  # an array of Python objects needs pickle, which is never enabled
            raise InputFileError(f"inputs {path} holds pickled objects ({exc})", hint=hint) from None
    if sorted(feed) != sorted(names):
        raise InputFileError(
            f"inputs {path} has arrays {sorted(feed)}; {taker} takes {sorted(names)}{_apart(feed, names)}", hint=hint
        )
    if batched:
        feed = whole_batches(feed, specs, str(path), taker)
    check_feed(feed, specs, str(path), taker, batched, npz=True)
    return feed


def _apart(feed: dict[str, np.ndarray], names: list[str]) -> str:
    """What sets a file's array names apart from the inputs: `` (missing 'control'; not an input: 'txt')``."""
    missing = [n for n in names if n not in feed]
    extra = [n for n in feed if n not in names]
    said = ([f"missing {', '.join(map(repr, missing))}"] if missing else []) + (
        [f"not an input: {', '.join(map(repr, extra))}"] if extra else []
    )
    return f" ({'; '.join(said)})" if said else ""


def _savez_call(names: list[str]) -> str:
    """``np.savez(path, ...)`` naming each input, as Python that parses: keywords (``ids=...``) where every name is
    one, else a dict unpacked (``**{"serving_default_input_1:0": ...}``), as tf2onnx's names are no identifiers."""
    if all(n.isidentifier() and not keyword.iskeyword(n) and n != "file" for n in names):
        return f"np.savez(path, {', '.join(f'{n}=...' for n in names)})"
    return f"np.savez(path, **{{{', '.join(f'{json.dumps(n)}: ...' for n in names)}}})"


def check_feed(
    feed: Mapping[str, np.ndarray],
    specs: list[TensorSpec],
    source: str,
    taker: str,
    batched: bool = False,
    npz: bool = False,
) -> None:
    """Each array against its input: dtype, rank and fixed sizes, at least one row, one row count among the inputs
    whose axis 0 is one axis (:func:`row_groups`: a two-tower model takes its texts and images in counts of their
    own), and finite values (a NaN in the data would otherwise surface as a failed gate or a skipped training
    step). ``batched``: rows on a fixed batch axis may be any whole number of batches (fed one batch at a time:
    :func:`in_batches`). ``npz``: the arrays come from an ``.npz`` (numpy's), so a fix that converts them is
    written for numpy alone; else for a torch tensor too (a data function's)."""
    for spec in specs:
        _check_array(spec, np.asarray(feed[spec.name]), source, taker, batched, npz)
    groups = row_groups(specs)
    for axis, names in groups.items():
        counts = {name: len(feed[name]) for name in names}
        if len(set(counts.values())) > 1:
            raise InputFileError(
                f"the inputs in {source} have different row counts {counts}"
                + (f" on their shared axis 0 {_said_axis(axis)}" if len(groups) > 1 else ""),
                hint=_row_count_fix(groups, axis),
            )


def row_groups(specs: list[TensorSpec]) -> dict[int | str | None, list[str]]:
    """The inputs by the axis 0 they declare: its name (``texts``, ``images``), or its fixed size; None groups those
    whose axis 0 has neither (an unknown size). Inputs of one group take one row count, those of different groups
    their own. Inputs without axes are left out."""
    groups: dict[int | str | None, list[str]] = {}
    for spec in specs:
        if spec.shape:
            groups.setdefault(_first_axis(spec.shape[0]), []).append(spec.name)
    return groups


def _first_axis(dim: int | str) -> int | str | None:
    """What identifies an axis 0: its name, its fixed size, or None where the graph gives neither."""
    if isinstance(dim, str):
        return dim or None
    return dim if dim >= 1 else None


def _said_axis(axis: int | str | None) -> str:
    """An axis 0 as the errors name it: ``'texts'``, ``fixed at 1``, ``of unknown size``."""
    if isinstance(axis, str):
        return f"'{axis}'"
    return f"fixed at {axis}" if axis is not None else "of unknown size"


def _row_count_fix(groups: dict[int | str | None, list[str]], axis: int | str | None) -> str:
    """The fix for inputs of one axis-0 group that differ in rows: one row per sample, naming the groups where the
    inputs have several (those of another axis 0 may differ)."""
    if len(groups) == 1:
        return "give every input one row per sample"
    others = "; ".join(f"{', '.join(n)} on {_said_axis(a)}" for a, n in groups.items() if a != axis)
    return (
        f"give {', '.join(groups[axis])} (axis 0 {_said_axis(axis)}) one row count; inputs on another axis 0 take "
        f"counts of their own ({others})"
    )


def _check_array(
    spec: TensorSpec, array: np.ndarray, source: str, taker: str, batched: bool = False, npz: bool = False
) -> None:
    want = [d if isinstance(d, int) and d >= 1 else None for d in spec.shape]
    if batched and want and want[0] and array.ndim == len(want) and len(array) and len(array) % want[0] == 0:
        want[0] = None  # whole batches of the fixed size, fed one at a time
    shape_ok = fits(array.shape, want)
    if array.dtype == np.dtype(spec.dtype) and _only_the_fixed_batch_differs(want, array.shape):
        raise InputFileError(
            f"input '{spec.name}' in {source} has {array.shape[0]} rows; {taker} fixes its batch axis at {want[0]} "
            f"({spec.dtype}{list(spec.shape)})",
            hint=(f"give a whole number of batches of {want[0]} rows" if batched else f"give {want[0]} rows")
            + ", or export the model with a dynamic batch axis (`kiln run` with model.onnx makes a fixed batch axis "
            "symbolic where the graph allows it)",
        )
    if array.dtype != np.dtype(spec.dtype) or not shape_ok:
        dims = ", ".join(str(w) if w is not None else str(d) for w, d in zip(want, spec.shape))
        cast = _cast_fix(array, np.dtype(spec.dtype), npz) if array.dtype != np.dtype(spec.dtype) else ""
        raise InputFileError(
            f"input '{spec.name}' in {source} is {array.dtype}{list(array.shape)}; {taker} takes {spec.dtype}[{dims}]",
            hint=f"give it as {spec.dtype}[{dims}]" + (cast if shape_ok else shape_fix(array.shape, want, taker, npz)),
        )
    if array.ndim and len(array) == 0:
        raise InputFileError(f"input '{spec.name}' in {source} has no rows", hint="give at least one sample")
    bad = _non_finite(array)
    if bad:
        raise InputFileError(
            f"input '{spec.name}' in {source} holds {bad}", hint="clean or drop those samples before handing them over"
        )


def shape_fix(shape: tuple[int, ...], want: list[int | None], taker: str, npz: bool) -> str:
    """How an array of ``shape`` becomes one of ``want`` (None: any size) where only its axes' order or its batch
    axis differs, as the tail of a fix: `` (one sample without its batch axis: x[None])``, `` (it looks like NCHW,
    and the model takes NHWC: x.transpose(0, 2, 3, 1))``; empty where the sizes themselves differ. ``npz``:
    numpy's arrays; else torch's ``permute`` is written beside numpy's ``transpose``."""
    x = "x"
    if len(shape) == len(want) - 1 and want[0] in (None, 1):
        x, shape = "x[None]", (1, *shape)
        if fits(shape, want):
            return " (one sample without its batch axis: x[None])"
    found = reordered(shape, want, taker, x)
    if found is None:
        return ""
    said, call = found
    torch = "" if npz else f"; a torch tensor: {call.replace('.transpose(', '.permute(')}"
    return f" ({said}: {call}{torch})"


def _cast_fix(array: np.ndarray, dtype: np.dtype, npz: bool) -> str:
    """How to turn ``array`` into ``dtype`` without changing what its values mean, as the tail of a fix
    (", e.g. x.astype('uint8')"), or why no cast does: floats in [0, 1] given to an unsigned integer input are an
    image's intensities, scaled to the dtype's range first (a cast alone makes every pixel 0 or 1); floats with
    fractions given to another integer input, or values past ``dtype``'s range, would lose their values to a cast,
    so none is offered; nor where the data holds NaN or infinity and ``dtype`` is an integer or bool, which no
    integer holds (a cast makes NaN -9223372036854775808). Integers given to a float input are cast and scaled as
    the model expects: a cast alone feeds a uint8 image's 0-255 to a model trained on 0-1. ``npz``: numpy's arrays;
    else a torch tensor's conversion is written beside it."""
    values = _finite_values(array)
    if dtype.kind in "iub" and array.dtype.kind == "f" and values.size < array.size:
        return (
            f": its data holds NaN or infinite values, which no {dtype} holds (a cast would make them arbitrary "
            "numbers); clean or drop those samples and give the values it takes"
        )
    if dtype.kind in "iub" and array.dtype.kind == "f" and values.size and (values != np.round(values)).any():
        if dtype.kind == "u" and values.min() >= 0 and values.max() <= 1:
            top = np.iinfo(dtype).max
            return (
                f", e.g. {_converted(f'(x * {top}).round()', dtype, npz)}: its values lie in [0, 1] (an image's "
                f"intensities), scaled to 0-{top} first, as a cast alone makes each one 0 or 1"
            )
        taken = "True/False" if dtype.kind == "b" else "integer"
        return f": its values have fractions, which a cast to {dtype} would cut off; give the {taken} values it takes"
    if values.size and not _within(values, dtype):
        return (
            f": its values ({values.min():.4g} to {values.max():.4g}) lie outside what {dtype} holds, which a cast "
            "would wrap or clip; give values the input takes"
        )
    if dtype.kind == "f" and array.dtype.kind in "iu":
        images = f" (uint8 images usually x.astype('{dtype}') / 255)" if array.dtype == np.uint8 else ""
        return f", e.g. {_converted('x', dtype, npz)}, and scale the values as the model expects{images}"
    return f", e.g. {_converted('x', dtype, npz)}"


def _converted(x: str, dtype: np.dtype, npz: bool) -> str:
    """``x`` converted to ``dtype``: numpy's ``astype``, and where the data may be torch tensors, ``.to``."""
    numpy = f"{x}.astype('{dtype}')"
    return numpy if npz else f"{numpy} (a torch tensor: {x}.to(torch.{dtype}))"


def _finite_values(array: np.ndarray) -> np.ndarray:
    """The finite values of a real ``array``, flat (none of a complex or other one: no cast is judged there)."""
    if array.dtype.kind not in "biuf":
        return np.empty(0)
    flat = np.asarray(array).ravel()
    return flat[np.isfinite(flat)] if array.dtype.kind == "f" else flat


def _within(values: np.ndarray, dtype: np.dtype) -> bool:
    """Whether every one of ``values`` is one ``dtype`` holds (a bool: 0 and 1 only)."""
    if dtype.kind == "b":
        return bool(np.isin(values, (0, 1)).all())
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
    elif dtype.kind == "f":
        info = np.finfo(dtype)
    else:
        return True
    return bool(values.min() >= info.min and values.max() <= info.max)


def fixed_batch(specs: list[TensorSpec]) -> int | None:
    """The batch size every input fixes on its first axis (a TorchScript export's 1), or None where one is dynamic,
    the inputs fix different sizes, or there are none."""
    first = {s.shape[0] if s.shape and isinstance(s.shape[0], int) and s.shape[0] >= 1 else None for s in specs}
    return first.pop() if len(first) == 1 else None


def rows_per_call(inputs: list[TensorSpec], outputs: list[TensorSpec]) -> int | None:
    """The rows one call of a graph answers where it is fewer than it may be fed: every input's batch axis is
    symbolic, yet every output fixes its axis 0 at one number (a graph network in the batch-of-one layout, exported
    with a batch axis, reads ``x[0]`` only and returns ``[1, nodes, C]``). Rows past those are fed and never read.
    None: the graph answers every row it is fed."""
    if not inputs or not outputs or any(not s.shape or not isinstance(s.shape[0], str) for s in inputs):
        return None
    first = {o.shape[0] if o.shape and isinstance(o.shape[0], int) and o.shape[0] >= 1 else None for o in outputs}
    return first.pop() if len(first) == 1 else None


def whole_batches(feed: Arrays, specs: list[TensorSpec], source: str, taker: str) -> Arrays:
    """``feed`` cut to a whole number of the batches a graph fixes (:func:`fixed_batch`), the rows past the last
    whole batch dropped with a warning saying how many (padding them would run made-up rows through the model);
    ``feed`` as it is where the batch axis is dynamic or the rows already fit. Fewer rows than one batch are an
    error: no row could be fed."""
    batch = fixed_batch(specs)
    counts = {len(np.asarray(v)) for v in feed.values() if np.ndim(v)}
    if batch is None or len(counts) != 1:  # another row count per input: check_feed says so
        return feed
    rows = counts.pop()
    if rows < batch:
        raise InputFileError(
            f"the inputs in {source} have {rows} rows; {taker} fixes its batch axis at {batch}",
            hint=f"give {batch} rows or more (a whole number of batches of {batch})",
        )
    kept = rows - rows % batch
    if kept < rows:
        log.warning(
            "%s: %d rows are not a whole number of batches of %d (%s fixes its batch axis): the last %d are left out",
            source,
            rows,
            batch,
            taker,
            rows - kept,
        )
    return {k: v[:kept] if np.ndim(v) else v for k, v in feed.items()}


def in_batches(feed: Mapping[str, np.ndarray], batch: int) -> list[Arrays]:
    """``feed``'s rows as consecutive feeds of ``batch`` rows each (the last one shorter where they do not divide).
    Inputs taken in counts of their own (10 texts beside 3 images: :func:`row_groups`) are each cut into as many
    consecutive parts as the longest needs, of at most ``batch`` rows; an input with fewer rows than parts repeats
    them, so that every feed holds rows of every input (a part without images is no call the model takes)."""
    counts = {len(v) for v in feed.values()}
    if len(counts) == 1:
        rows = counts.pop()
        return [{k: v[i : i + batch] for k, v in feed.items()} for i in range(0, rows, batch)]
    parts = -(-max(counts) // batch)
    cut = {k: np.array_split(np.resize(v, (max(len(v), parts), *v.shape[1:])), parts) for k, v in feed.items()}
    return [{k: cut[k][i] for k in feed} for i in range(parts)]


def run_batched(run: Callable[[Arrays], Mapping[str, np.ndarray]], feed: Arrays, batch: int | None) -> Arrays:
    """``run`` (inputs -> named outputs) on ``feed`` one batch of ``batch`` rows at a time, the outputs joined
    along their first axis: a graph that fixes its batch answers every row. An output without a batch axis (a
    batch-level scalar) is stacked, one value a batch. ``batch`` None: one run."""
    if batch is None:
        return dict(run(feed))
    parts = [run(part) for part in in_batches(feed, batch)]
    return {name: _joined([np.asarray(p[name]) for p in parts]) for name in parts[0]}


def _joined(arrays: list[np.ndarray]) -> np.ndarray:
    """Each batch's output joined along the first axis; 0-D outputs stacked (one value a batch)."""
    return np.stack(arrays) if arrays[0].ndim == 0 else np.concatenate(arrays)


def _only_the_fixed_batch_differs(want: list[int | None], shape: tuple[int, ...]) -> bool:
    """Whether an array fits its input but for the rows on a batch axis the graph fixed to a number."""
    if len(want) != len(shape) or not want or want[0] is None or want[0] == shape[0]:
        return False
    return all(w is None or w == d for w, d in zip(want[1:], shape[1:]))


def _non_finite(array: np.ndarray) -> str:
    """'3 NaN and 1 infinite values' (empty when every value is finite, or the dtype has no such values)."""
    if not np.issubdtype(array.dtype, np.floating) and not np.issubdtype(array.dtype, np.complexfloating):
        return ""
    nan = int(np.isnan(array).sum())
    inf = int(np.isinf(array).sum())
    parts = [f"{nan} NaN" if nan else "", f"{inf} infinite" if inf else ""]
    return " and ".join(p for p in parts if p) + " values" if nan or inf else ""


_INTEGER_DTYPES = {"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"}


def length_axes(inputs: Sequence[TensorSpec]) -> dict[str, tuple[str, int, str]]:
    """Input -> the (input, axis, axis name) it holds each row's length along: an integer ``[batch]`` or
    ``[batch, 1]`` input named like lengths (:func:`kiln.core.shapes.is_length_name`) beside inputs with the same
    rows and exactly one named axis besides them (a sequence's ``frames``); none where there are several (which one
    it measures is not known from an engine's inputs alone)."""
    out: dict[str, tuple[str, int, str]] = {}
    for spec in inputs:
        if not is_length_name(spec.name) or spec.dtype not in _INTEGER_DTYPES or spec.shape[1:] not in ([], [1]):
            continue
        axes: dict[str, tuple[str, int, str]] = {}
        for other in inputs:
            if other.name == spec.name or other.shape[:1] != spec.shape[:1]:
                continue
            for axis, dim in enumerate(other.shape[1:], 1):
                if isinstance(dim, str) and dim.isidentifier() and dim != spec.shape[0]:
                    axes.setdefault(dim, (other.name, axis, dim))
        if len(axes) == 1:
            out[spec.name] = next(iter(axes.values()))
    return out


def overlong_lengths(inputs: Sequence[TensorSpec], feed: Mapping[str, np.ndarray]) -> str | None:
    """Why a length input of ``feed`` (:func:`length_axes` of ``inputs``) holds a row longer than the axis it
    measures is in this feed (a sentence naming the input, the row, the value and the axis's size), or None. A mask
    built from it would reach past the padded positions, and an index from it past the axis (ONNX Runtime's error
    then names a node of the graph, not the input). A length of 0 is left to the model: some take an empty row."""
    for name, (other, axis, dim) in length_axes(inputs).items():
        lengths, taken = feed.get(name), feed.get(other)
        if lengths is None or taken is None or not lengths.size or taken.ndim <= axis:
            continue
        flat = lengths.reshape(len(lengths), -1)[:, 0] if lengths.ndim else lengths.reshape(1)
        row, size = int(flat.argmax()), taken.shape[axis]
        if flat[row] > size:
            return (
                f"input '{name}' holds {int(flat[row])} at row {row}: longer than the {size} positions of input "
                f"'{other}' axis {axis} ({dim}) in this call, the axis it measures"
            )
    return None
