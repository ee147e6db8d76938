"""Typed records of what the stages hand each other through files: engine metadata (``kiln-engine.json``),
precision variants (``variants.json``) and validation results (``validation.json``).

Each file is written and read through its record only, so a renamed or mistyped key fails where it is written,
not at some later read. A damaged, foreign or older file is refused with a clear message (``read``), never
half-understood. ``SCHEMA_VERSION`` changes when a field changes meaning.

A record's validator is built when it first reads or writes (``defer_build``), not when this module is imported:
opening one engine uses a few of these records, a run's stages others.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import numpy as np
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, FiniteFloat, ValidationError

from kiln.core.artifacts import write_text_atomic
from kiln.core.errors import InputFileError
from kiln.core.signature import BATCH_AXIS
from kiln.core.steps import LISTED_PERIOD
from kiln.core.timing import paired_ratio

SCHEMA_VERSION = 2
R = TypeVar("R", bound="Record")
# The values an integer input holds or may hold: one [smallest, largest] over the whole input, or one per column
# of its last axis (a fixed axis whose columns are features of their own: a recommender's categorical ids packed
# in one input, each column indexing a table of its own size), or one per cell of its last fixed axes, flattened
# (DLRM's multi-hot ids [batch, 4, 3], 4 tables of 3 ids each: cell t * 3 + j is table t's; cell_axes)
IntRange = list[int] | list[list[int]]


def _ordered(pair: list[float]) -> list[float]:
    """A value range whose smallest value is not past its largest (a hand-edited record's swapped pair refused)."""
    if pair[0] > pair[1]:
        raise ValueError(f"smallest value {pair[0]} is above largest {pair[1]}")
    return pair


# [smallest, largest] finite value of a float input
ValueRange = Annotated[list[FiniteFloat], Field(min_length=2, max_length=2), AfterValidator(_ordered)]


class Record(BaseModel):
    """A JSON file Kiln writes and later reads back. Unknown keys are refused: they mean another writer."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    schema_version: int = SCHEMA_VERSION

    def write(self, path: Path) -> None:
        write_text_atomic(path, self.model_dump_json(indent=2))

    @classmethod
    def read(cls: type[R], path: Path, hint: str) -> R:
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise InputFileError(f"{path} is missing", hint=hint) from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InputFileError(f"{path} is unreadable or not JSON ({exc})", hint=hint) from None
        return cls.parse(data, str(path), hint)

    @classmethod
    def parse(cls: type[R], data: Any, where: str, hint: str) -> R:
        if isinstance(data, dict) and data.get("schema_version", SCHEMA_VERSION) != SCHEMA_VERSION:
            raise InputFileError(
                f"{where} has schema version {data.get('schema_version')}; this Kiln reads {SCHEMA_VERSION}", hint=hint
            )
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            key = ".".join(str(p) for p in first["loc"]) or "(top level)"
            raise InputFileError(f"{where} is not a valid {cls.__name__} ({key}: {first['msg']})", hint=hint) from None


class Summary(BaseModel):
    """What a stage says about its run: kept in its manifest and report.json, read back typed (a cached stage's
    too). ``status`` is ``skipped`` when the stage had nothing to do (training with a checkpoint given)."""

    model_config = ConfigDict(extra="forbid", defer_build=True)

    status: Literal["ran", "skipped"] = "ran"

    def gate_failures(self) -> list[str] | None:
        """None where the stage has no gates; else the gates it failed (empty: passed)."""
        return None


class Part(BaseModel):
    """A nested part of a record (strict too)."""

    model_config = ConfigDict(extra="forbid", defer_build=True)


# ----------------------------------------------------------------------------------------------- engine metadata
class TensorSpec(Part):
    """One engine input or output: a symbolic axis is a string (``"batch"``), a fixed one an int."""

    name: str
    shape: list[int | str]
    dtype: str


class EngineSource(Part):
    file: str
    sha256: str
    kept_fp32: list[str] | None = None  # an FP16 engine converted from the FP32 graph: nodes kept FP32


def takes_size(pattern: list[int], size: int) -> bool:
    """Is ``size`` one of the sizes ``[period, *residues]`` allows (``[step, offset]``: offset + k * step)? Steps that
    list their sizes (:func:`kiln.core.steps.listed_steps`) take those sizes only: their period is no step, so a size
    a period past one (65600 for ``[65536, 64]``) is not taken."""
    period, *residues = pattern
    if period >= LISTED_PERIOD:
        return size in residues
    return size % period in {r % period for r in residues}


def steps_text(pattern: list[int], span: tuple[int, int] | None = None) -> str:
    """``[4, 0]`` -> " in steps of 4"; ``[4, 1]`` -> " in steps of 4 from 1"; ``[16, 0, 9, 10, 11]`` -> " at
    sizes 0, 9-11 modulo 16"; ``[65536, 64, 96]`` (sizes listed, :func:`kiln.core.steps.listed_steps`) -> " at sizes
    64, 96"; ``[1, 0]`` (any size) -> "". With the validated ``span`` (low, high), a pattern
    that admits few sizes there lists them (" at sizes 16, 32"), clearer than residues of a period as long as
    the range."""
    period, *residues = pattern
    if period <= 1:
        return ""
    if period >= LISTED_PERIOD:  # steps that list their sizes (:func:`kiln.core.steps.listed_steps`)
        return " at sizes " + ", ".join(map(str, sorted(set(residues))))
    if span is not None:
        sizes = [s for s in range(span[0], span[1] + 1) if takes_size(pattern, s)]
        if len(residues) > 1 and 0 < len(sizes) <= 8:
            return " at sizes " + ", ".join(map(str, sizes))
    if len(residues) == 1:
        return f" in steps of {period}" + (f" from {residues[0]}" if residues[0] else "")
    runs: list[list[int]] = []
    for r in sorted(set(residues)):
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    listed = ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)
    return f" at sizes {listed} modulo {period}"


def nearest_sizes(pattern: list[int], size: int, span: tuple[int, int]) -> list[int]:
    """The sizes next to ``size`` that ``pattern`` (:func:`takes_size`) allows within ``span`` (low, high): the
    largest below it and the smallest above it, where there are such."""
    period, *residues = pattern
    if period >= LISTED_PERIOD:
        candidates = residues
    else:
        candidates = [c for r in residues for c in (size - (size - r) % period, size + (r - size) % period)]
    taken = [c for c in candidates if span[0] <= c <= span[1] and c != size and takes_size(pattern, c)]
    below, above = [c for c in taken if c < size], [c for c in taken if c > size]
    return ([max(below)] if below else []) + ([min(above)] if above else [])


def _off_steps(engine: str, dim: str, size: int, pattern: list[int], span: tuple[int, int]) -> str:
    """Why ``size``, within the sizes an engine was validated for (``span``), is refused: its graph takes ``dim``
    only in steps (:func:`steps_text`) that the export or the build found (running the model between the range's
    ends, or torch.export's constraints), not validation, which runs at its own sizes only; with the sizes next to
    it that the engine takes."""
    near = nearest_sizes(pattern, size, span)
    which = "sizes it takes are" if len(near) > 1 else "size it takes is"
    said = f"; the nearest {which} {' and '.join(map(str, near))}" if near else ""
    return (
        f"engine {engine}'s graph takes {dim} only{steps_text(pattern, span)} (steps found at export or build, not "
        f"each validated){said}"
    )


class EngineMetadata(Record):
    """``kiln-engine.json``: what an engine is, what it takes, and how it was built.

    Every field but ``backend_info`` means the same for every backend (``builder_settings`` holds what each
    backend's builder was told and decided, free-form); ``backend_info`` is what the engine's backend records for
    its runner (session settings, autotuning, profiles), in that backend's record type (``Backend.record``).
    """

    name: str
    backend: str
    device: str
    precision: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    source: EngineSource
    files: dict[str, str]  # role -> file in the engine folder; "model" is the engine itself
    flavour: str
    versions: dict[str, str]
    batch_range: tuple[int, int] | None = None  # smallest and largest batch the engine takes; None: any
    # dynamic axis besides batch -> [smallest, largest]: the sizes the engine was built and validated for
    axis_ranges: dict[str, list[int]] = Field(default_factory=dict)
    # dynamic axis -> [period, *residues]: an axis the engine takes only at sizes whose remainder by the period is
    # one of the residues (a U-Net's height: [4, 0]; an FPN's that runs at 25-32 and 41-48: [16, 0, 9, ..., 15])
    axis_steps: dict[str, list[int]] = Field(default_factory=dict)
    # integer input -> [smallest, largest] value it may hold: the rows of the table it indexes (an embedding's
    # vocabulary; kiln.core.onnx_io.index_ranges), or one [smallest, largest] per column of its last axis (or per
    # cell of its last fixed axes: IntRange) where they index tables of different sizes (a recommender's categorical
    # ids packed in one input)
    index_ranges: dict[str, IntRange] = Field(default_factory=dict)
    # integer input -> the smallest value it may hold, where the axis it indexes has no size in the graph (a graph
    # neural network's nodes: the call's data sets the end) and so no index_ranges (kiln.core.onnx_io.index_floors)
    index_floors: dict[str, int] = Field(default_factory=dict)
    # float input -> [smallest, largest] value the data it was calibrated and validated on held (an image's pixels
    # in [0, 1]; kiln.core.inputs.float_ranges): `kiln validate ENGINE` without --inputs draws its random values
    # there, not from N(0, 1), far outside what an INT8 engine was calibrated for; empty: none recorded (an engine
    # built from an ONNX file, or by a Kiln that recorded none)
    value_ranges: dict[str, ValueRange] = Field(default_factory=dict)
    # how long the build took: in the build's summary, not written to kiln-engine.json, so that an identical rebuild
    # writes identical files and what follows it (validate, package) stays cached
    build_seconds: float = Field(0.0, exclude=True)
    # outputs whose rows are not the samples (validation found them; the package stage records them): a batch of
    # requests could not be split back, so servers run each request alone
    unbatched_outputs: list[str] = Field(default_factory=list)
    # the batch sizes validation compared the engine with the reference at (the package stage records them):
    # servers take batches up to the largest; empty: not recorded (an engine not validated), no limit but its own
    validated_batch_sizes: list[int] = Field(default_factory=list)
    # the class-logit output the run held to top-1 agreement (named in signature.logits_output, or Kiln's choice),
    # held to it again when the engine is validated on its own (`kiln validate ENGINE`); None: none was
    logits_output: str | None = None
    # what the run's agreement on those logits counted (EngineValidation.agreement): "decision" for a multi-label
    # head, each (sample, label) pair's decision, which `kiln validate ENGINE` then counts too
    logits_agreement: Literal["top1", "decision"] = "top1"
    settings_hash: str = ""
    size_bytes: int = 0
    file_hashes: dict[str, str] = Field(default_factory=dict)  # file -> sha256, checked by load_engine
    builder_settings: dict[str, Any] = Field(default_factory=dict)  # what the builder was told and decided
    # FLOPs per sample and the share computed in each precision (kiln.stages.precision.audit.engine_audit)
    audit: dict[str, Any] = Field(default_factory=dict)
    backend_info: dict[str, Any] = Field(default_factory=dict)

    def input_names(self) -> list[str]:
        return [i.name for i in self.inputs]

    def max_batch(self) -> int | None:
        """The largest batch a server may send the engine: the smaller of its profiles' largest (``batch_range``)
        and the largest batch it was validated at (:meth:`validated_max_batch`); None: neither bounds it."""
        profile = self.batch_range[1] if self.batch_range else None
        limits = [b for b in (profile, self.validated_max_batch()) if b is not None]
        return min(limits) if limits else None

    def validated_max_batch(self) -> int | None:
        """The largest batch validation compared the engine at (None: not recorded). Servers take every batch up
        to it, as they take every size of an axis between the smallest and largest it was validated at."""
        return max(self.validated_batch_sizes) if self.validated_batch_sizes else None

    def refusal(self, feed: dict[str, Any]) -> str | None:
        """Why a server refuses this request (one array per input): an input's axes differ from those its graph
        fixes (:meth:`misshapen`), it is empty (:meth:`empty_input`), has more rows than the engine was validated
        for (:meth:`outside_batch`), its shapes lie outside the sizes the engine was validated for
        (:meth:`outside_range`), or an input holds an index past the table it indexes (:meth:`outside_values`);
        None when the engine takes it."""
        shapes = {k: v.shape for k, v in feed.items()}
        return (
            self.misshapen(shapes)
            or self.empty_input(shapes)
            or self.outside_batch(shapes)
            or self.outside_range(shapes)
            or self.outside_values(feed)
        )

    def outside_batch(self, shapes: dict[str, tuple[int, ...]]) -> str | None:
        """Why inputs of these shapes hold more rows than the largest batch the engine was validated at (a sentence
        naming the input and the limit), or None. Inputs with a fixed first axis have no batch to hold to it."""
        limit = self.validated_max_batch()
        if limit is None:
            return None
        for spec in self.inputs:
            shape = shapes.get(spec.name, ())
            if spec.shape and isinstance(spec.shape[0], str) and shape and shape[0] > limit:
                return (
                    f"input '{spec.name}' has {shape[0]} rows: engine {self.name} was validated for batches up to "
                    f"{limit}"
                )
        return None

    def misshapen(self, shapes: dict[str, tuple[int, ...]]) -> str | None:
        """Why inputs of these shapes differ from what the engine's graph fixes (a sentence naming the input: its
        number of axes, or an axis the graph holds at one size given another), or None. Said before any backend
        sees them, whose own error (ONNX Runtime's, TensorRT's) does not say the size is one the graph was exported
        with."""
        for spec in self.inputs:
            shape = shapes.get(spec.name)
            if shape is not None and len(shape) != len(spec.shape):
                dims = ", ".join(map(str, spec.shape))
                return (
                    f"input '{spec.name}' has {len(shape)} axes {list(shape)}: engine {self.name} takes "
                    f"{len(spec.shape)} ([{dims}])"
                )
        fixed = self.fixed_axis(shapes)
        return None if fixed is None else self.fixed_refusal(*fixed, shape=shapes[fixed[0]])

    def fixed_refusal(self, name: str, axis: int, size: int, fixed: int, shape: Sequence[int] = ()) -> str:
        """The sentence refusing input ``name`` at ``size`` on an axis its graph fixes at ``fixed``; with the input's
        ``shape``, also the order of its axes the engine takes where that is all that differs (:meth:`reordered`)."""
        sentence = (
            f"input '{name}' axis {axis} is {size}: engine {self.name} takes {fixed} there (a fixed size of its graph)"
        )
        found = self.reordered(name, shape)
        return sentence if found is None else f"{sentence}; {found[0]}: {found[1]}"

    def reordered(self, name: str, shape: Sequence[int]) -> tuple[str, str] | None:
        """Where input ``name`` of ``shape`` has the fixed sizes the engine takes in another order of its axes (an
        NHWC image given to an NCHW engine): what it looks like and the call that reorders it
        (:func:`reordered`); else None."""
        spec = next((s for s in self.inputs if s.name == name), None)
        if spec is None or len(shape) != len(spec.shape):
            return None
        return reordered(shape, [d if isinstance(d, int) and d >= 1 else None for d in spec.shape], "the engine")

    def fixed_axis(self, shapes: dict[str, tuple[int, ...]]) -> tuple[str, int, int, int] | None:
        """The first axis of these shapes at a size other than the one the engine's graph fixes it at (an integer
        in the input's shape): (input, axis, size given, fixed size); None when every fixed axis matches."""
        for spec in self.inputs:
            for axis, (dim, size) in enumerate(zip(spec.shape, shapes.get(spec.name, ()))):
                if isinstance(dim, int) and dim >= 1 and size != dim:
                    return spec.name, axis, size, dim
        return None

    def empty_input(self, shapes: dict[str, tuple[int, ...]]) -> str | None:
        """Why inputs of these shapes are empty (a sentence naming the input: 0 rows, or 0 on another axis, a
        sequence of length 0), or None. Refused before any backend sees them: ONNX Runtime's LSTM and GRU kernels
        abort the process on a batch of 0 (an upstream bug), taking a server's stub or replica with it. An axis
        besides the batch that the engine was validated at 0 for (its :attr:`axis_ranges` start at 0: a decoder's
        empty past) takes 0; the batch never does (:meth:`empty_axis`)."""
        found = self.empty_axis(shapes)
        return None if found is None else self.empty_refusal(*found)

    def empty_refusal(self, name: str, axis: int, dim: str | int) -> str:
        """The sentence refusing input ``name`` at size 0 on ``axis`` (named ``dim``), with the sizes the engine
        was validated for on that axis where it records them."""
        if str(dim) == BATCH_AXIS or (axis == 0 and str(dim) not in self.axis_ranges):
            return f"input '{name}' has 0 rows: engine {self.name} takes no empty inputs"
        if str(dim) in self.axis_ranges:
            low, high = self.axis_ranges[str(dim)]
            return (
                f"input '{name}' axis {axis} ({dim}) is 0: engine {self.name} was {self.vouched()} for {dim} from "
                f"{low} to {high}"
            )
        return f"input '{name}' axis {axis} ({dim}) is 0: engine {self.name} takes no empty inputs"

    def empty_axis(self, shapes: dict[str, tuple[int, ...]]) -> tuple[str, int, str | int] | None:
        """The first axis of these shapes at size 0 that the engine does not take at 0: (input, axis, the axis's
        name or fixed size); None when there is none. The batch is never taken at 0; another axis (a count of its
        own on axis 0 too: a two-tower model's texts) is taken at 0 where its :attr:`axis_ranges` start at 0."""
        for spec in self.inputs:
            for axis, (dim, size) in enumerate(zip(spec.shape, shapes.get(spec.name, ()))):
                if size == 0 and (str(dim) == BATCH_AXIS or self.axis_ranges.get(str(dim), [1])[0] > 0):
                    return spec.name, axis, dim
        return None

    def outside_range(self, shapes: dict[str, tuple[int, ...]]) -> str | None:
        """Why inputs of these shapes lie outside the sizes the engine was validated for (a sentence naming the
        input, the axis and the range, for each named axis outside: a source and a target length both), or differ
        on an axis they share (:meth:`tied_mismatch`), or None."""
        tied = self.tied_mismatch(shapes)
        if tied is not None:
            return tied
        return "; ".join(why for _, why in self.refused_sizes(shapes).values()) or None

    def refused_sizes(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[bool, str]]:
        """Each named axis of these shapes at a size the engine does not take (:attr:`axis_ranges`, and
        :attr:`axis_steps` between them), once per axis name (inputs sharing an axis are one size here): its name ->
        (whether the size lies within the range, off the steps only; the sentence naming the input, the axis and
        the one rule it breaks)."""
        said: dict[str, tuple[bool, str]] = {}
        for spec in self.inputs:
            for axis, dim in enumerate(spec.shape):
                shape = shapes.get(spec.name, ())
                held = dim in self.axis_ranges or dim in self.axis_steps if isinstance(dim, str) else False
                if not held or axis >= len(shape) or dim in said:
                    continue
                refused = self._refused_size(spec.name, axis, dim, shape[axis])
                if refused is not None:
                    said[dim] = refused
        return said

    def _refused_size(self, name: str, axis: int, dim: str, size: int) -> tuple[bool, str] | None:
        """Why input ``name``'s ``axis`` at ``size`` breaks a rule of the sizes the engine takes on ``dim``, naming
        only the one it breaks, as (within the range, the sentence): past its range (:attr:`axis_ranges`), the
        range; within it, the steps of its graph (:attr:`axis_steps`) and the sizes next to it that they take.
        None where the engine takes the size. An axis with steps and no range (an engine built from an exported file
        given no sizes keeps the steps its export recorded) is held to its steps alone."""
        low, high = self.axis_ranges.get(dim, (0, size + max(self.axis_steps.get(dim, [1])[0], 1)))
        pattern = self.axis_steps.get(dim, [1, 0])
        where = f"input '{name}' axis {axis} ({dim}) is {size}"
        if not low <= size <= high:
            return False, f"{where}: engine {self.name} was {self.vouched()} for {dim} from {low} to {high}"
        if not takes_size(pattern, size):
            return True, f"{where}: {_off_steps(self.name, dim, size, pattern, (low, high))}"
        return None

    def vouched(self) -> str:
        """What the engine's sizes were checked by: "validated" once validation recorded the batches it compared
        the engine at (the package stage writes them), else "built" (a ``kiln build`` engine no one validated)."""
        return "validated" if self.validated_batch_sizes else "built"

    def tied_mismatch(self, shapes: dict[str, tuple[int, ...]]) -> str | None:
        """Why inputs of these shapes cannot run together: two of them differ on an axis of one name (the batch, a
        sequence both share), which the engine takes as one size; None when every named axis has one size. Only
        the graph's names tie axes: a two-tower model's images and texts come in counts of their own."""
        seen: dict[str, tuple[str, int, int]] = {}  # axis name -> (input, axis, size) first seen
        for spec in self.inputs:
            shape = shapes.get(spec.name, ())
            for axis, dim in enumerate(spec.shape[: len(shape)]):
                if not isinstance(dim, str) or not dim.isidentifier():  # fixed, or "?": an exporter's "unknown"
                    continue
                name, at, size = seen.setdefault(dim, (spec.name, axis, shape[axis]))
                if size == shape[axis]:
                    continue
                which = (
                    f"input '{name}' differs on axes {at} and {axis}, both {dim},"
                    if name == spec.name
                    else f"inputs '{name}' and '{spec.name}' differ on axis {dim}"
                )
                return f"{which} ({size} against {shape[axis]}): engine {self.name} takes them at one size"
        return None

    def outside_values(self, feed: dict[str, Any]) -> str | None:
        """Why an integer input holds a value outside :attr:`index_ranges` (a sentence naming the input, the value
        and the range), or None."""
        found = first_outside(self.index_ranges, feed)
        if found is None:
            return self.below_floor(feed)
        name, value, (low, high), cell = found
        where = cell_text(name, cell)
        return (
            f"input '{name}' holds {value}{where}: engine {self.name} takes values from {low} to {high} "
            f"{'there ' if where else ''}(the positions of the axis it indexes: a table's rows, a graph's nodes)"
        )

    def below_floor(self, feed: dict[str, Any]) -> str | None:
        """Why an input holds a value below its :attr:`index_floors` (a sentence naming the input, the value, where
        it lies and the floor), or None. ONNX's index ops count a negative index from the end of the axis, where
        PyTorch's refuse it: unchecked, the engine would answer a call its model refuses."""
        found = first_below(self.index_floors, feed)
        if found is None:
            return None
        name, value, at, floor = found
        return (
            f"input '{name}' holds {value} at {name}[{', '.join(map(str, at))}]: engine {self.name} takes values "
            f"from {floor} there (positions along an axis it indexes: a graph's nodes, counted from {floor})"
        )


def first_below(floors: dict[str, int], feed: dict[str, Any]) -> tuple[str, int | float, tuple[int, ...], int] | None:
    """The first input of ``feed`` holding a value below its floor in ``floors``: its name, its least value, that
    value's position and the floor; None when none is below. Floats are compared as a Cast to an integer truncates
    them (-0.5 is 0). Inputs missing from ``feed`` or empty are not checked."""
    for name, floor in floors.items():
        array = feed.get(name)
        if array is None or not getattr(array, "size", 0):
            continue
        if array.dtype.kind == "f":  # a NaN is no index: left to the graph
            values = np.trunc(array)
            if np.isnan(values).all():
                continue
            at = int(np.nanargmin(values))
        else:
            values, at = array, int(np.argmin(array))
        if values.flat[at] < floor:
            position = tuple(int(i) for i in np.unravel_index(at, array.shape))
            return name, _number(array.flat[at].item()), position, floor
    return None


# the layouts a permutation of an image's axes turns one into the other: (the array's, the input's)
_LAYOUTS = {
    (0, 2, 3, 1): ("NCHW", "NHWC"),
    (0, 3, 1, 2): ("NHWC", "NCHW"),
    (0, 2, 3, 4, 1): ("NCDHW", "NDHWC"),
    (0, 4, 1, 2, 3): ("NDHWC", "NCDHW"),
}


def reordered(shape: Sequence[int], want: Sequence[int | None], taker: str, x: str = "x") -> tuple[str, str] | None:
    """Where an array of ``shape`` has the sizes ``want`` (None: any size) fixes in another order of its axes (an
    NHWC image given to an NCHW model): what it looks like (``it looks like NHWC, and the engine takes NCHW``) and
    the numpy call that reorders ``x`` (``x.transpose(0, 3, 1, 2)``); None where no order fits. A size refused on
    one axis then has its fix in that order, not in a graph that lets the axis vary."""
    order = _permutation(tuple(shape), want)
    if order is None:
        return None
    given, taken = _LAYOUTS.get(order, (None, None))
    said = f"it looks like {given}, and {taker} takes {taken}" if given else "its axes are in another order"
    return said, f"{x}.transpose({', '.join(map(str, order))})"


def _permutation(shape: tuple[int, ...], want: Sequence[int | None]) -> tuple[int, ...] | None:
    """The first order of ``shape``'s axes (the batch axis kept first where it can be) that gives sizes ``want``
    takes; None where no order does, or ``shape`` has too many axes to try them all. The array's first axis (its
    rows) stays first or moves to an axis of any size (a time-major ``[T, N, C]``), never to a fixed size that the
    row count matches only by chance (64 rows of 48 frames are not 48 rows of 64)."""
    if len(shape) != len(want) or len(shape) > 6:
        return None
    for order in itertools.permutations(range(len(shape))):
        rows_to = order.index(0)
        if (rows_to == 0 or want[rows_to] is None) and fits(tuple(shape[i] for i in order), want):
            return order
    return None


def fits(shape: tuple[int, ...], want: Sequence[int | None]) -> bool:
    """Whether ``shape`` has the sizes ``want`` fixes (None: any)."""
    return len(shape) == len(want) and all(w is None or w == d for w, d in zip(want, shape))


# Where in an input a value lies that its range per cell refuses: the cell's position along the input's last axes
Cell = tuple[int, ...]


def first_outside(
    ranges: dict[str, IntRange], feed: dict[str, Any]
) -> tuple[str, int | float, list[int], Cell | None] | None:
    """The first input of ``feed`` holding a value outside its range in ``ranges``: its name, the value past the
    range (the least below it, else the most above it), the range, and the cell it lies in (its position along the
    input's last axes, :func:`cell_axes`) where the input has a range per cell (:data:`IntRange`; else None); None
    when all are inside. A float input (one cast to an index in the graph) is held to the range as the Cast
    truncates it, and a NaN or infinite value in it is outside any range. Inputs missing from ``feed`` or empty are
    not checked; an input whose axes do not match its cells is held to the widest of them."""
    import numpy as np  # the feed's arrays are numpy's already; the records alone load without it

    for name, bounds in ranges.items():
        array = feed.get(name)
        if array is None or not getattr(array, "size", 0):
            continue
        axes = cell_axes(bounds, array.shape)
        if axes is None:
            parts = [(None, array, whole_range(bounds))]
        else:
            flat, cells = array.reshape(-1, len(bounds)), by_column(bounds, len(bounds)) or []
            parts = [(tuple(int(k) for k in np.unravel_index(i, axes)), flat[:, i], c) for i, c in enumerate(cells)]
        for cell, values, (low, high) in parts:
            value = _past_range(np.asarray(values), low, high)
            if value is not None:
                return name, value, [low, high], cell
    return None


def _past_range(values: Any, low: int, high: int) -> int | float | None:
    """The value of ``values`` (a numpy array) past ``[low, high]``: the least below it, else the most above it;
    None where all lie inside. Floats are compared as a Cast to an integer truncates them (toward 0: -0.5 is 0),
    and are said as given; a NaN or an infinity (no integer) is past any range."""
    import numpy as np

    if values.dtype.kind != "f":
        least, most = int(values.min()), int(values.max())
    else:
        if not np.isfinite(values).all():
            return float(values[~np.isfinite(values)][0])
        least, most = float(values.min()), float(values.max())
    if math.trunc(least) < low:
        return _number(least)
    return _number(most) if math.trunc(most) > high else None


def _number(value: int | float) -> int | float:
    """``value`` as a sentence says it: an integral float as an integer (5000, not 5000.0)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def cell_text(name: str, cell: Cell | None) -> str:
    """Where in input ``name`` a value of ``cell`` (:func:`first_outside`) lies, for a sentence: `` in column 2
    (x[..., 2])`` on the last axis alone, `` at x[..., 3, 0]`` on several; empty for a range over the whole input."""
    if cell is None:
        return ""
    index = ", ".join(str(i) for i in cell)
    return f" in column {index} ({name}[..., {index}])" if len(cell) == 1 else f" at {name}[..., {index}]"


def whole_range(bounds: IntRange) -> list[int]:
    """One ``[smallest, largest]`` over every column of an :data:`IntRange` (itself where it is one already)."""
    if bounds and isinstance(bounds[0], list):
        return [min(c[0] for c in bounds), max(c[1] for c in bounds)]  # type: ignore[index]
    return list(bounds)  # type: ignore[arg-type]


def by_column(bounds: IntRange, columns: int) -> list[list[int]] | None:
    """The ``[smallest, largest]`` of each column of an :data:`IntRange` that holds one per column of a last axis
    of ``columns``; None for one range over the whole input, or columns that do not match (then
    :func:`whole_range` bounds it)."""
    if bounds and isinstance(bounds[0], list) and len(bounds) == columns:
        return [list(c) for c in bounds]  # type: ignore[union-attr]
    return None


def cell_axes(bounds: IntRange, shape: Sequence[int]) -> tuple[int, ...] | None:
    """The sizes of the last axes of an array of ``shape`` whose cells, flattened, an :data:`IntRange` of one range
    per cell ranges one by one: the fewest last axes past the first (the batch) that hold as many cells as it has
    ranges, the last alone for a range per column (the count tells the two apart: 3 ranges over a ``[batch, 4, 3]``
    input are its columns, 12 its cells). None for one range over the whole input, or a count no last axes hold
    (then :func:`whole_range` bounds it)."""
    if not (bounds and isinstance(bounds[0], list)):
        return None
    return trailing_axes(shape, len(bounds))


def trailing_axes(shape: Sequence[int], cells: int) -> tuple[int, ...] | None:
    """The fewest last axes of ``shape``, past the first, that hold ``cells`` cells together, or None."""
    for first in range(len(shape) - 1, 0, -1):
        if math.prod(shape[first:]) == cells:
            return tuple(shape[first:])
    return None


# --------------------------------------------------------------------------------------------- precision variants
class PrecisionVariant(Part):
    """One graph of the precision stage. ``backend_paths``: a graph made for one engine kind
    (``"<backend>-<device>"``) instead of ``path``; ``report``: the stage's own diagnostics (calibration, casts,
    fallback rounds), for people."""

    path: str
    kept_fp32: list[str] = Field(default_factory=list)
    reasons: dict[str, str] = Field(default_factory=dict)  # node -> why it stayed FP32
    backend_paths: dict[str, str] = Field(default_factory=dict)
    vs_fp32: dict[str, Any] | None = None  # comparator statistics against the FP32 graph (and what top-1 counted)
    fallback_passed: bool = True
    unmade: str | None = None  # why ``path`` (the graph every backend without its own reads) was not made
    report: dict[str, Any] = Field(default_factory=dict)


class Variants(Record):
    """``variants.json``: precision name -> its graph."""

    variants: dict[str, PrecisionVariant]
    axis_sizes: dict[str, list[int]] = Field(default_factory=dict)  # dynamic axis besides batch -> sizes in the data
    int_ranges: dict[str, IntRange] = Field(default_factory=dict)  # integer input -> its values in the data
    value_ranges: dict[str, ValueRange] = Field(default_factory=dict)  # float input -> its values in the data


# ------------------------------------------------------------------------------------------------------ validation
class Percentiles(Part):
    """Latency of one call in ms. Timed in interleaved rounds (:func:`kiln.core.timing.interleave`): ``p50`` is the
    median of the per-round medians (``rounds``), ``ci95`` its 95 % interval from them, and ``spread`` that
    interval's width over p50; ``p90`` and ``p99`` are of every call, held at p50 or above."""

    p50: float
    p90: float
    p99: float
    ci95: tuple[float, float] | None = None
    rounds: list[float] = Field(default_factory=list)
    spread: float | None = None

    def over(self, fast: Percentiles) -> float:
        """This latency over ``fast``'s (how many times faster ``fast`` is): the median of the ratios paired round by
        round (:func:`kiln.core.timing.paired_ratio`)."""
        return paired_ratio(self.rounds, fast.rounds, self.p50, fast.p50)

    @classmethod
    def of(cls, times_ms: list[float]) -> Percentiles:
        """p50, p90 and p99 of the calls timed (numpy's linear interpolation), without rounds."""
        p50, p90, p99 = np.percentile(np.asarray(times_ms), [50, 90, 99])
        return cls(p50=float(p50), p90=float(p90), p99=float(p99))


class Memory(Part):
    """Peak memory while loading and running at the largest batch, and the size on disk (``method`` says how the
    peak was measured: it differs per device, see :mod:`kiln.stages.validate.memory`)."""

    peak_mb: float | None = None
    method: str = ""
    size_bytes: int | None = None  # engine folder / model weights (parameters and buffers)


class Baseline(Part):
    """A PyTorch run of the trained model: ``kind`` eager or compile (torch.compile), on ``device``."""

    backend: str = "pytorch"
    kind: str = "eager"
    device: str = "cpu"
    precision: str = "fp32"
    accuracy: float | None
    accuracy_note: str | None = None  # why ``accuracy`` is None (no labels, no class logits, labels of no size)
    samples: int
    latency_ms: dict[str, Percentiles]
    logits_output: str | None = None  # the class-logit output of top-1 and accuracy (None: not a classifier)
    # Labels per position (kiln.core.labels): how many of the held-out positions carry one, which accuracy and top-1
    # count (None: labels per row, or none)
    labelled_positions: int | None = None
    metric: float | None = None  # validate.metric on the held-out split (metric_name says which)
    metric_name: str | None = None
    metric_default: bool = False  # the metric is the default for float targets, not validate.metric
    metric_scale: float | None = None  # an error metric's relative drop is over this: the targets' spread
    compared: list[str] = Field(default_factory=list)  # the outputs every engine is compared on
    shapes: list[dict[str, int]] = Field(default_factory=list)  # dynamic axis sizes validated at (besides batch)
    scored_at: dict[str, int] | None = None  # the dynamic axis sizes accuracy and the metric are measured at
    own_sizes: dict[str, int] | None = None  # the data's own dynamic axis sizes (the held-out inputs as given)
    memory: Memory | None = None
    error: str | None = None  # why this baseline has no numbers (e.g. torch.compile failed, no CUDA for torch)

    @property
    def label(self) -> str:
        """``eager-cuda``, ``compile-cpu``, ``eager-cuda-fp16``: how reports and speedups name it."""
        return f"{self.kind}-{self.device}" + ("" if self.precision == "fp32" else f"-{self.precision}")


class EngineValidation(Part):
    """One engine against the baseline. Statistics come from :mod:`kiln.core.compare`."""

    name: str
    backend: str
    precision: str
    device: str
    status: Literal["validated", "not-runnable"]
    # a torch engine of a 16- or 8-bit precision whose model runs under torch.autocast (its weights float16, the ops
    # autocast keeps in float32 so): not in its precision throughout, as its report says
    autocast: bool = False
    passed: bool | None = None
    reason: str | None = None
    max_abs_err: float | None = None  # the worst gated output's (as cosine, rel_err): what the gates judged
    rel_err: float | None = None
    cosine: float | None = None
    top1_agreement: float | None = None  # of the class-logit output, where the gates hold it (gated_outputs)
    top1_ties: float | None = None  # of its rows, those that flipped on a tie (kiln.core.compare), in the agreement
    # what the class logits' top1_agreement counts (kiln.core.compare.Agreement): "top1", the argmax per row;
    # "decision", a multi-label head's decision per (sample, label) pair. Records of before it: "top1"
    agreement: Literal["top1", "decision"] = "top1"
    accuracy: float | None = None
    metric: float | None = None  # validate.metric at the data's own shape (the baseline's metric_name)
    outputs: dict[str, dict[str, float | int | None]] = Field(
        default_factory=dict
    )  # output -> OutputStats, worst over shapes: every output, gated or not
    shapes: list[dict[str, int]] = Field(default_factory=list)
    batch_sizes: list[int] = Field(default_factory=list)  # compared with the reference at each (empty: not compared)
    latency_ms: dict[str, Percentiles] = Field(default_factory=dict)
    speedup_vs_baseline: dict[str, float] = Field(default_factory=dict)  # vs eager PyTorch on the engine's device
    speedups: dict[str, dict[str, float]] = Field(default_factory=dict)  # baseline label -> batch -> p50 ratio
    # baseline label -> batch -> 95 % interval of the ratio, from the two medians paired round by round
    speedup_ci: dict[str, dict[str, tuple[float, float]]] = Field(default_factory=dict)
    memory: Memory | None = None
    # batch -> achieved TFLOP/s at p50 and its share of the device's peak (kiln.stages.validate.roofline)
    roofline: dict[str, dict[str, Any]] = Field(default_factory=dict)
    flops_per_sample: int | None = None  # from the engine's audit
    precision_share: dict[str, float] = Field(default_factory=dict)  # its audit: share of FLOPs per precision
    failures: list[str] = Field(default_factory=list)
    hints: list[str] = Field(default_factory=list)  # what to try about the failures (not gates themselves)
    dropped: str | None = None  # why a validated engine is not packaged (precision.require_speedup)
    gates: dict[str, float | list[str] | None] = Field(default_factory=dict)  # the thresholds it was held to, and
    # gated_outputs where set (report shows them)

    @classmethod
    def of(cls, meta: EngineMetadata, status: Literal["validated", "not-runnable"]) -> EngineValidation:
        """The entry of the engine ``meta`` describes, before any comparison: its name, backend, precision, device,
        and whether its model runs under torch.autocast (its builder's settings say)."""
        return cls(
            name=meta.name,
            backend=meta.backend,
            precision=meta.precision,
            device=meta.device,
            status=status,
            autocast=bool(meta.builder_settings.get("autocast")),
        )


NONE_VALIDATED = "no engine could be validated on this machine"  # a failure no gate threshold changes


class ValidationResult(Record, Summary):
    """``validation.json``, and the validate stage's summary."""

    passed: bool
    baseline: Baseline  # the accuracy reference: eager PyTorch FP32 on the CPU
    baselines: list[Baseline] = Field(default_factory=list)  # what engines are timed against, per device and kind
    chosen: dict[str, str] = Field(default_factory=dict)  # batch -> the fastest engine that passed its gates
    engines: list[EngineValidation]
    failures: list[str]
    speed_vs_fp32: list[dict[str, Any]] = Field(default_factory=list)  # kiln.stages.precision.speed's rows
    # batch -> why the chosen engine is not the fastest measured (its lead within the noise of the timing)
    choice_notes: dict[str, str] = Field(default_factory=dict)
    timing: dict[str, Any] = Field(default_factory=dict)  # how latency was timed: rounds, load, busy or not
    peaks: dict[str, dict[str, Any]] = Field(default_factory=dict)  # device -> measured GEMM peak, datasheet
    dropped: list[str] = Field(default_factory=list)
    # outputs whose rows depend on the whole batch or are not the samples (kiln.stages.accuracy.check.batch_coupled)
    batch_coupled: list[str] = Field(default_factory=list)
    # where the reference answers one class at every held-out row or position (an untrained model, or one that
    # predicts the prior): which, in words ("decides negative at all 512 rows of output 'logits'"); accuracy is then
    # that class's share and top-1 agreement asks only to keep it (kiln.stages.accuracy.check.Reference.one_class)
    one_class: str | None = None

    def gate_failures(self) -> list[str]:
        return [] if self.passed else self.failures or ["see report.md"]

    def served_metadata(self, meta: EngineMetadata) -> EngineMetadata:
        """``meta`` as servers take the engine once validated: with the outputs validation found not to be the
        samples' rows (served unbatched) and the batch sizes this engine was compared at (served up to the largest).
        ``meta`` itself where validation recorded neither (a ``validation.json`` that predates them)."""
        update: dict[str, Any] = {}
        if self.batch_coupled:
            update["unbatched_outputs"] = self.batch_coupled
        entry = next((e for e in self.engines if e.name == meta.name), None)
        if entry is not None and entry.batch_sizes:
            update["validated_batch_sizes"] = sorted(entry.batch_sizes)
        return meta.model_copy(update=update) if update else meta
