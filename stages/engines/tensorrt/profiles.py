"""Optimization profiles (min/opt/max shape per input) for dynamic shapes, checked against the model's inputs.

Shapes are written in full (batch axis included), the way TensorRT's ``IOptimizationProfile.set_shape`` takes
them. The default profile makes the leading axis dynamic over 1..max batch and fixes every other axis to the
ONNX input's shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kiln.core.errors import ConfigError
from kiln.core.records import TensorSpec
from kiln.stages.engines.tensorrt.config import ShapeRange

Profile = dict[str, ShapeRange]


def default_profiles(
    inputs: list[TensorSpec], max_batch: int, axis_sizes: dict[str, list[int]] | None = None
) -> list[Profile]:
    """One profile, batch 1..``max_batch`` (opt at ``max_batch``: throughput rows matter most for serving); a
    dynamic axis named in ``axis_sizes`` (``signature.dynamic_axes`` name -> [smallest, largest]) spans its sizes,
    opt at the largest."""
    profile: Profile = {}
    sizes = axis_sizes or {}
    for spec in inputs:
        lo: list[int] = [1]
        hi: list[int] = [max_batch]
        for d in spec.shape[1:]:
            if isinstance(d, int) and d >= 1:
                lo.append(d)
                hi.append(d)
            elif isinstance(d, str) and d in sizes:
                lo.append(min(sizes[d]))
                hi.append(max(sizes[d]))
            else:
                raise _unsized_error(spec, sizes)
        profile[spec.name] = ShapeRange(min=lo, opt=hi, max=hi)
    return [profile]


def _unsized_error(spec: TensorSpec, sizes: dict[str, list[int]]) -> ConfigError:
    """The error for ``spec``'s dynamic axes besides the batch with no sizes known: named ones get sizes by their
    names; an axis the file leaves unnamed (no name to give sizes by) is named first, in signature.dynamic_axes."""
    axes = [(i, d) for i, d in enumerate(spec.shape) if i and not (isinstance(d, int) and d >= 1) and d not in sizes]
    named = [str(d) for _, d in axes if isinstance(d, str) and d]
    shown = "[" + ", ".join(_dim_text(i, d) for i, d in enumerate(spec.shape)) + "]"
    which = ", ".join(repr(d) if isinstance(d, str) and d else f"axis {i} (unnamed)" for i, d in axes)
    problem = (
        f"input '{spec.name}' (shape {shown}) has dynamic axes [{which}] besides the batch axis, with no sizes "
        "known for them"
    )
    if named:
        hint = (
            "give signature.shapes their sizes by those names (kiln build: --set "
            f"'signature.shapes={{{named[0]}: [16, 64]}}'; kiln run: with signature.dynamic_axes naming them), or "
            "build.tensorrt.profiles with min/opt/max for this input"
        )
    else:
        axis = axes[0][0]
        hint = (
            f"the file leaves axis {axis} unnamed, so no size can be given by its name: name it (kiln run: "
            f"signature.dynamic_axes: {{{spec.name}: {{{axis}: seq}}}}, with signature.shapes: {{seq: [16, 64]}}; or "
            "re-export the file with named dynamic axes), or give build.tensorrt.profiles with min/opt/max for "
            "this input"
        )
    return ConfigError(problem, hint=hint)


def _dim_text(axis: int, dim: int | str) -> str:
    """One axis of a shape as a message writes it: a size, a name, or ``?`` for a dynamic axis the file leaves
    unnamed (0 in a spec: never a size here, where the batch axis aside every size is checked to be 1 or more)."""
    if isinstance(dim, int) and (dim >= 1 or axis == 0):
        return str(dim)
    return f"'{dim}'" if isinstance(dim, str) and dim else "?"


def check_profiles(
    profiles: Sequence[Profile], inputs: list[TensorSpec], axis_sizes: dict[str, list[int]] | None = None
) -> None:
    """Every profile names exactly the model's inputs, with their rank and fixed dims, and together they take every
    size of each named axis in ``axis_sizes`` (:func:`check_covers`): else a ConfigError."""
    names = [s.name for s in inputs]
    if not profiles:
        raise ConfigError("no optimization profile to build with", hint="remove build.tensorrt.profiles: []")
    for i, profile in enumerate(profiles):
        where = f"build.tensorrt.profiles[{i}]"
        unknown, missing = sorted(set(profile) - set(names)), sorted(set(names) - set(profile))
        if unknown or missing:
            raise ConfigError(
                f"{where} does not match the model's inputs {names}: "
                + ", ".join(filter(None, [unknown and f"unknown {unknown}", missing and f"missing {missing}"])),
                hint=f"name each of the model's inputs ({', '.join(names)}: the ONNX file's graph inputs) once in "
                "every profile, with a min, opt and max shape",
            )
        for spec in inputs:
            _check_range(where, spec, profile[spec.name])
    check_covers(profiles, inputs, axis_sizes or {})


def check_covers(profiles: Sequence[Profile], inputs: list[TensorSpec], axis_sizes: dict[str, list[int]]) -> None:
    """The profiles take every size of each named dynamic axis from its smallest to its largest in ``axis_sizes``
    (``signature.shapes``, else the data's): those sizes are the engine's recorded ``axis_ranges``, which
    validation checks and a server passes on, and TensorRT refuses a size no profile takes. Else a ConfigError
    naming the first size none takes and what they cover."""
    for name, sizes in axis_sizes.items():
        spans = [span for profile in profiles if (span := _span(profile, inputs, name)) is not None]
        if not sizes or not spans:
            continue  # an axis of no input (an output's): nothing the profiles shape
        lo, hi = min(sizes), max(sizes)
        gap = _first_untaken(spans, lo, hi)
        if gap is None:
            continue
        taken = [(a, b) for a, b in sorted(spans) if a <= b]
        fits = (lo, gap - 1) if gap > lo else (taken[0] if taken else None)
        narrow = f"signature.shapes={{{name}: [{fits[0]}, {fits[1]}]}}" if fits else "signature.shapes"
        said = ", ".join(f"{a} to {b}" for a, b in taken) or "no size"
        raise ConfigError(
            f"build.tensorrt.profiles take {name} {said}, the engine's sizes (signature.shapes, else the data's) "
            f"are {name} {lo} to {hi}: it would be validated and served at {name}={gap}, which no profile takes "
            "(TensorRT refuses it)",
            hint=f"widen the profiles' min/max on that axis to take {name} {lo} to {hi}, or give sizes the profiles "
            f"take (--set '{narrow}')",
        )


def _span(profile: Profile, inputs: list[TensorSpec], name: str) -> tuple[int, int] | None:
    """The sizes of the dynamic axis ``name`` that ``profile`` takes: the overlap of its min..max on every input
    axis of that name (inputs sharing an axis take one size there); None where no input has it."""
    ranges = [
        (profile[spec.name].min[axis], profile[spec.name].max[axis])
        for spec in inputs
        for axis, dim in enumerate(spec.shape)
        if dim == name and spec.name in profile and axis < len(profile[spec.name].min)
    ]
    if not ranges:
        return None
    return max(a for a, _ in ranges), min(b for _, b in ranges)


def _first_untaken(spans: list[tuple[int, int]], lo: int, hi: int) -> int | None:
    """The smallest size from ``lo`` to ``hi`` in none of ``spans`` (each min..max, inclusive); None: all taken."""
    size = lo
    for a, b in sorted(spans):
        if a > size:
            break
        size = max(size, b + 1)
    return size if size <= hi else None


def _check_range(where: str, spec: TensorSpec, rng: ShapeRange) -> None:
    shape = spec.shape
    if len(rng.min) != len(shape):
        raise ConfigError(
            f"{where}.{spec.name}: rank {len(rng.min)} but the model's input has shape {shape}",
            hint=f"give {len(shape)} dims for min, opt and max",
        )
    for axis, dim in enumerate(shape):
        fixed = isinstance(dim, int) and dim > 0
        if fixed and not (rng.min[axis] == rng.opt[axis] == rng.max[axis] == dim):
            raise ConfigError(
                f"{where}.{spec.name}: axis {axis} is fixed to {dim} in the model, the profile gives "
                f"min/opt/max {rng.min[axis]}/{rng.opt[axis]}/{rng.max[axis]}",
                hint=f"use {dim} on axis {axis}, or export the model with that axis dynamic",
            )


def profile_for(profiles: Sequence[dict[str, Any]], shapes: dict[str, tuple[int, ...]]) -> int | None:
    """Index of the first profile (as stored in metadata) whose ranges contain ``shapes``."""
    for i, profile in enumerate(profiles):
        if all(
            all(lo <= d <= hi for lo, d, hi in zip(profile[n]["min"], s, profile[n]["max"]))
            and len(s) == len(profile[n]["min"])
            for n, s in shapes.items()
            if n in profile
        ):
            return i
    return None


def as_json(profiles: Sequence[Profile]) -> list[dict[str, Any]]:
    return [{name: rng.model_dump() for name, rng in p.items()} for p in profiles]
