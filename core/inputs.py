"""The one maker of random model inputs, from declared input specs (an engine's metadata or a graph's inputs)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import numpy as np

from kiln.core.errors import ConfigError
from kiln.core.records import IntRange, TensorSpec, by_column, whole_range

# A batch's inputs may take at most this share of the machine's memory: outputs, activations and a reference
# copy come on top of them.
MEMORY_SHARE = 0.25
BATCH_HINT = "lower signature.batch_sizes (its largest value also sizes the engines' profiles and autotuning)"


def memory_bytes() -> int:
    """Physical memory of this machine (the bound for a batch; a GPU's is smaller still)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not POSIX: no bound known
        return 1 << 62


def check_batch_fits(
    specs: list[TensorSpec], batch: int, what: str = "signature.batch_sizes", hint: str = BATCH_HINT
) -> None:
    """Refuse a batch whose inputs alone could not fit in memory, before anything is allocated (a batch of a
    billion samples would otherwise die inside numpy or the engine with a traceback, or swap the machine)."""
    need = 0
    for spec in specs:
        n = batch
        for axis, dim in enumerate(spec.shape):
            n *= dim if axis and isinstance(dim, int) and dim >= 1 else 1
        try:
            need += n * np.dtype(spec.dtype).itemsize
        except TypeError:  # a sequence or map input: not sized here
            continue
    limit = memory_bytes() * MEMORY_SHARE
    if need > limit:
        raise ConfigError(
            f"{what}: a batch of {batch} samples needs {need / 2**30:.1f} GiB for its inputs alone; "
            f"this machine has {memory_bytes() / 2**30:.1f} GiB of memory",
            hint=hint,
        )


AxisSizes = Mapping[str, Mapping[int, int]]  # input name -> axis -> size


def named_sizes(specs: list[TensorSpec], axis_sizes: Mapping[str, Sequence[int]]) -> dict[str, dict[int, list[int]]]:
    """The sizes of each symbolic axis besides the batch, per input and axis, where ``axis_sizes`` names it
    (``signature.shapes``: a name the graph gives the axis -> sizes, as ``kiln build FILE`` takes them): the
    graph stages' own reading of the sizes a user gives by axis name. Axes it does not name are left out."""
    out: dict[str, dict[int, list[int]]] = {}
    for spec in specs:
        for axis, dim in enumerate(spec.shape):
            if axis and isinstance(dim, str) and axis_sizes.get(dim):
                out.setdefault(spec.name, {})[axis] = sorted(set(axis_sizes[dim]))
    return out


def largest_sizes(specs: list[TensorSpec], axis_sizes: Mapping[str, Sequence[int]]) -> dict[str, dict[int, int]] | None:
    """A size for every symbolic axis besides the batch, per input: the largest its named axis takes in the data
    (``axis_sizes``: ``signature.dynamic_axes`` name -> sizes, :func:`named_sizes`), so each axis is at a size the
    model takes (a decoder's target length need not reach the source's); an axis not named there gets the largest
    of all. None without sizes (callers then pass one size of their own)."""
    if not axis_sizes:
        return None
    default = max(max(v) for v in axis_sizes.values())
    named = named_sizes(specs, axis_sizes)
    out: dict[str, dict[int, int]] = {}
    for spec in specs:
        for axis, dim in enumerate(spec.shape):
            if axis and not (isinstance(dim, int) and dim >= 1):
                sizes = named.get(spec.name, {}).get(axis)
                out.setdefault(spec.name, {})[axis] = max(sizes) if sizes else default
    return out


def random_inputs(
    specs: list[TensorSpec],
    batch: int,
    dynamic: int | AxisSizes | None = None,
    int_high: int = 1,
    seed: int = 0,
    hint: str = "pass concrete input arrays",
    int_ranges: Mapping[str, IntRange] | None = None,
) -> dict[str, np.ndarray]:
    """One array per input: ``batch`` on a symbolic first (batch) axis, ``dynamic`` on any other symbolic axis (one
    size for all, or per input and axis; ``None`` or an axis it lacks: an error naming ``hint``); integers in
    [0, ``int_high``] (1 by default, so any embedding accepts them), or in an input's own ``[low, high]`` of
    ``int_ranges`` (the values the data holds; each column of the last axis in its own, where it has one per
    column: :data:`~kiln.core.records.IntRange`), booleans at random, floats standard normal. A fixed axis keeps
    its size."""
    check_batch_fits(specs, batch, hint=f"{BATCH_HINT}, or {hint}")
    rng = np.random.default_rng(seed)
    feed: dict[str, np.ndarray] = {}
    for spec in specs:
        shape = [_size(d, i, batch, dynamic, spec, hint) for i, d in enumerate(spec.shape)]
        dtype = np.dtype(spec.dtype)
        if dtype == np.bool_:
            feed[spec.name] = rng.random(shape) < 0.5
        elif dtype.kind in "iu":
            bounds = (int_ranges or {}).get(spec.name, [0, int_high])
            feed[spec.name] = integers(rng, bounds, shape).astype(dtype)
        else:
            feed[spec.name] = rng.standard_normal(shape).astype(dtype)
    return feed


def integers(rng: np.random.Generator, bounds: IntRange, shape: list[int]) -> np.ndarray:
    """Random integers of ``shape`` within ``bounds``: each column of the last axis within its own range where
    ``bounds`` has one per column (a packed categorical input: column 0 takes a 10-row table's ids only), else all
    within the one range (the widest of the columns' where they do not match the last axis)."""
    columns = by_column(bounds, shape[-1] if len(shape) >= 2 else 0)
    if columns:
        low, high = np.array(columns).T
        return rng.integers(low, high + 1, size=shape)
    low, high = whole_range(bounds)
    return rng.integers(low, high + 1, size=shape)


def _size(dim: int | str, axis: int, batch: int, dynamic: int | AxisSizes | None, spec: TensorSpec, hint: str) -> int:
    if isinstance(dim, int) and dim >= 1:
        return dim
    if axis == 0:
        return batch
    if isinstance(dynamic, Mapping):
        dynamic = dynamic.get(spec.name, {}).get(axis)
    if dynamic is None:
        problem = f"input '{spec.name}' has dynamic axes besides the batch axis (shape {spec.shape})"
        raise ConfigError(problem, hint=hint)
    return dynamic
