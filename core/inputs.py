"""The one maker of random model inputs, from declared input specs (an engine's metadata or a graph's inputs)."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence

import numpy as np

from kiln.core.errors import ConfigError, ModelError
from kiln.core.records import IntRange, TensorSpec, by_column, cell_axes, whole_range

log = logging.getLogger("kiln.inputs")

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


def check_batch_axis(specs: list[TensorSpec], what: str) -> None:
    """Refuse inputs without a common batch axis: Kiln takes axis 0 of every input as the batch (its batch sizes,
    the slices the checks compare, the rows of random inputs), so an input without axes (a scalar flag or trip count:
    nothing to slice), an input whose axis 0 is a fixed size beside one whose axis 0 is dynamic (a temperature
    ``[1]`` beside ``x [batch, 8]``, a time-major RNN's ``h0 [1, batch, H]`` beside ``x [T, batch, F]``: fed a row per
    sample, which the graph refuses), or inputs fixed at different sizes (a graph neural network's ``x [nodes, 8]``
    beside ``edge_index [2, edges]``) would be cut or repeated where they must not and fail inside ONNX Runtime.
    Inputs that all fix axis 0 at one size (a published file's batch of 1) pass; ``what`` names the model or engine
    in the error."""
    _refuse_scalars(specs, what)
    firsts = {s.name: s.shape[0] for s in specs}
    fixed = {name: dim for name, dim in firsts.items() if isinstance(dim, int) and dim >= 1}
    free = [name for name in firsts if name not in fixed]  # dynamic axis 0
    if not fixed or (not free and len(set(fixed.values())) == 1):
        return
    shown = {s.name: f"'{s.name}' {_written(s.shape)}" for s in specs}
    named = [{d for d in s.shape if isinstance(d, str) and d} for s in specs]
    shared = sorted(set.intersection(*named))
    ones = [name for name, dim in fixed.items() if dim == 1]
    others = {dim for name, dim in firsts.items() if name not in ones}
    if ones and free and len(others) == 1 and not shared:  # a dynamic batch on every input but those fixed at 1
        problem = f"input {shown[ones[0]]} has a fixed axis 0 of 1 while input {shown[free[0]]} takes a batch there"
        hint = _batch_axis_hint([s for s in specs if s.name in ones])
    elif free:
        name = next(iter(fixed))
        problem = (
            f"input {shown[name]} has a fixed axis 0 ({fixed[name]}) while axis 0 of input {shown[free[0]]} is dynamic"
        )
        hint = _batch_first_hint(specs, shared[0]) if shared else batch_of_one_hint(specs)
    else:
        problem = "the inputs fix axis 0 at different sizes (" + ", ".join(shown[n] for n in fixed) + ")"
        hint = _batch_first_hint(specs, shared[0]) if shared else batch_of_one_hint(specs)
    raise ModelError(
        f"{what}: {problem}: Kiln takes axis 0 of every input as the batch, and these inputs have no common one",
        hint=hint,
    )


def _batch_first_hint(specs: list[TensorSpec], axis: str) -> str:
    """The fix for inputs that share a batch axis ``axis`` elsewhere than first (a time-major RNN's): take them
    batch-first and move the axis back in the model."""
    moved = ", ".join(f"{s.name} {_written(_first(s.shape, axis))}" for s in specs)
    later = next(s for s in specs if s.shape[0] != axis)
    back = f"{later.name}.movedim(0, {later.shape.index(axis)})"
    return (
        f"export the model taking its inputs with the shared axis '{axis}' first ({moved}), its forward moving it "
        f"back where its layers take it ({back})"
    )


def _first(shape: list[int | str], axis: str) -> list[int | str]:
    """``shape`` with the axis named ``axis`` moved to the front."""
    at = shape.index(axis)
    return [axis, *shape[:at], *shape[at + 1 :]]


def _refuse_scalars(specs: list[TensorSpec], what: str) -> None:
    """Refuse an input without axes (shape ``[]``): Kiln slices, repeats and joins every input along axis 0."""
    scalars = [s for s in specs if not s.shape]
    if scalars:
        raise ModelError(
            f"{what}: input '{scalars[0].name}' has no axes (shape []): Kiln takes axis 0 of every input as the "
            "batch, slicing and repeating the inputs along it",
            hint=_batch_axis_hint(scalars),
        )


def _batch_axis_hint(specs: list[TensorSpec]) -> str:
    """The fix for inputs without a batch axis of their own (a flag, a trip count, a temperature shared by the
    batch): export them with one, a value per sample."""
    taking = ", ".join(f"{s.name} {_written(['batch', *s.shape[1:]])}" for s in specs)
    return (
        f"export the model taking {taking}, a batch axis first (one value per sample, repeated where the whole "
        "batch shares it), or fold the value into the model as a constant"
    )


def batch_of_one_hint(specs: list[TensorSpec]) -> str:
    """The fix for inputs without a common batch axis (:func:`check_batch_axis`): one sample a call, each input under
    a leading axis of one, written out for ``specs``."""
    wrapped = ", ".join(f"{s.name} {_written([1, *s.shape])}" for s in specs if s.shape)
    taken = ", ".join(f"{s.name}[0]" for s in specs if s.shape)
    return (
        f"give the model each sample (a whole graph) as a batch of one: export it taking {wrapped} (its forward "
        f"takes {taken} and returns its outputs with a leading axis of one) and set signature.batch_sizes: [1]; its "
        "engines take one sample a call and are served unbatched (docs/byom.md, inputs without a batch axis)"
    )


def _written(shape: Sequence[int | str]) -> str:
    """A declared shape as the errors write it: ``[2, edges]`` (an axis of unknown size: ``?``)."""
    return "[" + ", ".join(str(d) if d not in (0, "") else "?" for d in shape) + "]"


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


def recorded_sizes(
    specs: list[TensorSpec], axis_ranges: Mapping[str, Sequence[int]], what: str = "random inputs"
) -> dict[str, dict[int, int]]:
    """A size for each symbolic axis besides the batch that ``axis_ranges`` names (an engine's recorded
    ``axis_ranges``: axis name -> [smallest, largest]), per input and axis: the largest of its range, the size that
    runs every position the engine was built for. Axes it does not name are left out, so that
    :func:`random_inputs` refuses them (no size is known to be one the engine takes). The log says which sizes
    ``what`` (the inputs made at them) takes, since the range's other sizes are not run."""
    sizes = {
        name: {axis: max(taken) for axis, taken in axes.items()}
        for name, axes in named_sizes(specs, axis_ranges).items()
    }
    chosen = {spec.shape[axis]: size for spec in specs for axis, size in sizes.get(spec.name, {}).items()}
    if chosen:
        said = ", ".join(f"{dim}={size} (of {list(axis_ranges[dim])})" for dim, size in chosen.items())
        log.warning(
            "%s at %s: the largest size of each range the engine records (its smaller ones are not run)", what, said
        )
    return sizes


def random_inputs(
    specs: list[TensorSpec],
    batch: int,
    dynamic: int | AxisSizes | None = None,
    int_high: int = 1,
    seed: int = 0,
    hint: str = "pass concrete input arrays",
    int_ranges: Mapping[str, IntRange] | None = None,
    float_ranges: Mapping[str, Sequence[float]] | None = None,
) -> dict[str, np.ndarray]:
    """One array per input: ``batch`` on a symbolic first (batch) axis, ``dynamic`` on any other symbolic axis (one
    size for all, or per input and axis; ``None`` or an axis it lacks: an error naming ``hint``); integers in an
    input's own ``[low, high]`` of ``int_ranges`` (the values the data holds; each column of the last axis in its
    own, where it has one per column: :data:`~kiln.core.records.IntRange`); where ``int_ranges`` is given but names
    no range for a uint8 input (it indexes no table: an image's pixels, as :func:`kiln.core.onnx_io.index_ranges`
    tells), over 0..255, since at 0 and 1 alone an image is black and its outputs barely vary between samples;
    other integers in [0, ``int_high``] (1 by default, so any embedding accepts them as ids, uint8 ones too where
    nothing says they index none); booleans at random, each row of their last axis holding both values
    (:func:`booleans`); floats uniform in their own ``[low, high]`` of ``float_ranges`` (the values the data held:
    an engine calibrated on images in [0, 1] is judged there, not on N(0, 1) values it never saw), else standard
    normal, but whole numbers in the range ``int_ranges`` gives a float input (one the graph casts to an index:
    :func:`kiln.core.onnx_io.index_ranges`). A fixed axis keeps its size."""
    check_batch_fits(specs, batch, hint=f"{BATCH_HINT}, or {hint}")
    rng = np.random.default_rng(seed)
    feed: dict[str, np.ndarray] = {}
    for spec in specs:
        shape = [_size(d, i, batch, dynamic, spec, hint) for i, d in enumerate(spec.shape)]
        dtype = np.dtype(spec.dtype)
        if dtype == np.bool_:
            feed[spec.name] = booleans(rng, shape)
        elif dtype.kind in "iu":
            pixels = int_ranges is not None and dtype == np.uint8
            bounds = (int_ranges or {}).get(spec.name, [0, 255 if pixels else int_high])
            feed[spec.name] = integers(rng, bounds, shape).astype(dtype)
        elif spec.name in (int_ranges or {}):  # a float the graph casts to an index (a diffusion timestep)
            feed[spec.name] = integers(rng, int_ranges[spec.name], shape).astype(dtype)
        elif spec.name in (float_ranges or {}):
            low, high = float_ranges[spec.name]
            feed[spec.name] = rng.uniform(low, high, shape).astype(dtype)
        else:
            feed[spec.name] = rng.standard_normal(shape).astype(dtype)
    return feed


def float_ranges(feed: Mapping[str, np.ndarray]) -> dict[str, list[float]]:
    """Input name -> [smallest, largest] finite value, for each float input of ``feed`` (the data an engine is
    calibrated and validated on): what ``kiln-engine.json`` records as ``value_ranges``, so that random inputs are
    drawn within it (:func:`random_inputs`). Inputs without a finite value are left out."""
    out = {}
    for name, values in feed.items():
        values = np.asarray(values)
        finite = values[np.isfinite(values)] if values.dtype.kind == "f" else values[:0]
        if finite.size:
            out[name] = [float(finite.min()), float(finite.max())]
    return out


def booleans(rng: np.random.Generator, shape: list[int]) -> np.ndarray:
    """Random booleans of ``shape`` where each row of the last axis (at least two wide, beside a batch axis) holds
    both values, and so does each cut of it to its first or last positions (two or more): a boolean input is mostly
    a mask over positions, and a row of one value masks all of them under either convention (True = padding as
    ``key_padding_mask``, True = attend), so attention over it has no key: PyTorch answers such a row with finite
    values where the exported Softmax gives NaN, and the checks comparing them would fail on inputs no real sample
    has (the export probes that case once on its own, :func:`kiln.stages.export.parity.warn_empty_masks`). The
    cuts are those the checks make of inputs drawn at the largest size of an
    axis (:func:`kiln.core.shapes.resize`). So the second position is the first's opposite and the last the
    second-to-last's; the draw stays fixed by the generator's seed."""
    mask = np.asarray(rng.random(shape) < 0.5)  # an array at shape [] too, not a numpy scalar
    if mask.ndim >= 2 and mask.shape[-1] >= 2:
        mask[..., 1] = ~mask[..., 0]
        mask[..., -1] = ~mask[..., -2]
    return mask


def integers(rng: np.random.Generator, bounds: IntRange, shape: list[int]) -> np.ndarray:
    """Random integers of ``shape`` within ``bounds``: each column of the last axis (or cell of the last axes,
    :func:`~kiln.core.records.cell_axes`) within its own range where ``bounds`` has one per column or cell (a packed
    categorical input: column 0 takes a 10-row table's ids only), else all within the one range (the widest of the
    columns' where they do not match the last axes)."""
    axes = cell_axes(bounds, shape)
    if axes:
        low, high = np.array(by_column(bounds, len(bounds))).T.reshape(2, *axes)
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
