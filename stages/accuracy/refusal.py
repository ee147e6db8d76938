"""A reference in ONNX Runtime that refuses the shapes it is checked at, said as one error with its fix: validation's
reference (the ONNX file a run starts from) and the precision stage's (the FP32 graph its variants are judged
against) run the same held-out inputs at every validated shape, so a graph that cannot take one of those sizes
(a position table shorter than ``signature.shapes`` asks for, axes named apart that it takes at one size only)
must stop both with the same words, not with ONNX Runtime's traceback."""

from __future__ import annotations

import json
import re
from collections.abc import Callable

import numpy as np

from kiln.core.data import Feed
from kiln.core.errors import ModelError
from kiln.core.labels import exporter_made
from kiln.core.shapes import Axes
from kiln.core.text import short_reason
from kiln.stages.accuracy.check import own_point


def refusing(
    run: Callable[[Feed], dict[str, np.ndarray]],
    shown: str,
    axes: Axes,
    largest: Feed,
    inputs: str = "validation",
    own: dict[str, int] | None = None,
) -> Callable[[Feed], dict[str, np.ndarray]]:
    """``run`` (a reference in ONNX Runtime) with any failure of it raised as :func:`reference_error`."""

    def guarded(fed: Feed) -> dict[str, np.ndarray]:
        try:
            return run(fed)
        except Exception as exc:  # ONNX Runtime's own error, whatever its type: shapes the graph does not take
            raise reference_error(exc, fed, shown, axes, largest, inputs, own) from None

    return guarded


def reference_error(
    exc: Exception,
    fed: Feed,
    shown: str,
    axes: Axes,
    largest: Feed,
    inputs: str = "validation",
    own: dict[str, int] | None = None,
) -> ModelError:
    """ONNX Runtime's failure running the reference ``shown`` on ``fed`` (the ``inputs`` ones: validation's, or
    those a direct command checks on), named with the shapes fed: validation sets each named axis apart (one at its
    smallest beside the others at their largest), which a graph refuses where it takes axes named apart (an
    exporter's per-input names) at one size only. The fix names alike the axes of one size in the data
    (``largest``: every axis at its largest), the sizes the graph ran at in the export. Where the sizes fed are
    below ``own`` (the rows' own size of each axis), Kiln cut the rows itself, and the fix says so first
    (:func:`_resized_hint`): a cut row may index what was cut away (an edge list's node ids). Rows lengthened
    (repeated) index nothing new: a graph that refuses them refuses the size."""
    shapes = {k: f"{np.asarray(v).dtype}{list(np.shape(v))}" for k, v in fed.items()}
    at, hint = own_point(fed, axes), _tie_hint(axes, largest)
    if own is not None and any(v < own.get(k, v) for k, v in at.items()):
        tied = _tied_alike(axes, largest) != {k: dict(v) for k, v in axes.items()}
        hint = _resized_hint(inputs, own, at) + (f"; or {hint}" if tied else "")
    left = _left_out(fed, axes, largest)
    if left:
        hint = f"{_left_out_hint(axes, left)}; or {hint}"
    return ModelError(
        f"ONNX Runtime cannot run the reference, {shown}, on the {inputs} inputs {shapes}: {short_reason(exc, 300)}",
        hint=hint,
    )


def _left_out(fed: Feed, axes: Axes, largest: Feed) -> dict[tuple[str, int], str]:
    """Input axes besides the batch that ``axes`` leaves out, each with the name of a named axis at the same place
    (axis number) that it matches in size in ``largest`` (every axis at its largest) but not in ``fed``: an axis left
    out stays at the data's own size while the named one is set apart, so an attention mask of 12 positions meets ids
    cut to 3, which the graph refuses where the two are one axis (a file that names its mask's axis apart, or leaves
    it unnamed)."""
    sized: dict[tuple[int, int], str] = {}  # (axis, size at its largest) -> name, of the axes set apart in fed
    for k, dims in axes.items():
        for axis, label in dims.items():
            if int(axis) and k in fed and k in largest and np.ndim(largest[k]) > int(axis):
                size = int(np.shape(largest[k])[int(axis)])
                if np.shape(fed[k])[int(axis)] != size:
                    sized.setdefault((int(axis), size), label)
    out: dict[tuple[str, int], str] = {}
    for k, value in largest.items():
        for axis in range(1, np.ndim(value)):
            place = (axis, int(np.shape(value)[axis]))
            if axis not in {int(a) for a in axes.get(k, {})} and place in sized and k in fed:
                out[(k, axis)] = sized[place]
    return out


def _left_out_hint(axes: Axes, left: dict[tuple[str, int], str]) -> str:
    """The fix for axes left out of signature.dynamic_axes that follow a named one: name them alike."""
    named = {k: dict(v) for k, v in axes.items()}
    for (k, axis), label in left.items():
        named.setdefault(k, {})[axis] = label
    which = " and ".join(f"input '{k}' axis {axis}" for k, axis in left)
    labels = " and ".join(f"'{label}'" for label in dict.fromkeys(left.values()))
    return (
        f"signature.dynamic_axes leaves out {which}, kept at the data's own size while {labels} varied: where it "
        f"follows {labels}, name it alike: --set 'signature.dynamic_axes={_axes_text(named)}' (or the same under "
        "signature: in the run's config)"
    )


def _resized_hint(inputs: str, own: dict[str, int], at: dict[str, int]) -> str:
    """The fix where Kiln resized the ``inputs`` rows from their ``own`` sizes to the validated sizes ``at`` (cut
    to their first positions on some axis), as it does to check every validated shape: rows at a validated size,
    taken as they are, or validated sizes that include the rows' own."""
    given = "--calibration" if inputs == "random" else inputs

    def said(point: dict[str, int]) -> str:
        return ", ".join(f"{k}={v}" for k, v in point.items())

    return (
        f"Kiln resized the {inputs} rows from their own sizes ({said(own)}) to the validated sizes ({said(at)}), "
        "cutting them along an axis, which breaks a row whose values index the positions cut away (an edge to a "
        f"node past the nodes kept): give {given} rows at a validated size ({said(at)}), taken as they are, or "
        f"signature.shapes that include the rows' own sizes ({said(own)})"
    )


def _tie_hint(axes: Axes, largest: Feed) -> str:
    """The fix for a reference that refuses the validated shapes: ``axes`` (input -> {axis: name}) with the axes of
    one size in ``largest`` named alike, as the ``--set`` of signature.dynamic_axes, where that ties any; else (the
    axes already named alike, or none to tie) sizes the graph takes, saying those it was run at."""
    named = _tied_alike(axes, largest)
    if named == {k: dict(v) for k, v in axes.items()}:  # naming alike ties nothing more: the sizes are the matter
        sizes = ", ".join(f"{k}={v}" for k, v in own_point(largest, axes).items())
        at = f" (it was run at {sizes}; a position table shorter than that refuses it)" if sizes else ""
        return f"give signature.shapes sizes the graph takes{at}"
    return (
        f"name alike the axes the graph takes at one size only: --set 'signature.dynamic_axes={_axes_text(named)}' "
        "(or the same under signature: in the run's config), or give signature.shapes sizes the graph takes"
    )


def _tied_alike(axes: Axes, largest: Feed) -> dict[str, dict[int, str]]:
    """``axes`` with the axes of each size in ``largest`` under one name: the first that a person gave among them
    (not an exporter's, :func:`kiln.core.labels.exporter_made`), else ``seq`` for axes that are all axis 1, else
    ``size<N>`` (``seq<N>`` where another size took ``seq``)."""
    sizes: dict[int, list[tuple[str, int]]] = {}
    for k, dims in axes.items():
        for axis in dims:
            if k in largest and np.ndim(largest[k]) > axis:
                sizes.setdefault(int(np.shape(largest[k])[axis]), []).append((k, axis))
    out = {k: dict(v) for k, v in axes.items()}
    taken = {n for dims in axes.values() for n in dims.values()}
    for size, where in sizes.items():
        names = list(dict.fromkeys(axes[k][a] for k, a in where))
        if len(names) < 2:
            continue
        given = [n for n in names if not exporter_made(n)]
        name = given[0] if given else "seq" if all(a == 1 for _, a in where) else f"size{size}"
        name = f"{name}{size}" if name in taken - set(names) else name
        taken.add(name)
        for k, a in where:
            out[k][a] = name
    return out


def _axes_text(axes: dict[str, dict[int, str]]) -> str:
    """``{input_ids: {1: seq}, attention_mask: {1: seq}}``: signature.dynamic_axes as YAML's flow style writes it
    (an input name YAML would not read as that text in quotes)."""

    def key(name: str) -> str:
        return name if re.fullmatch(r"[A-Za-z_][\w.:/-]*", name) else json.dumps(name)

    inner = (", ".join(f"{a}: {n}" for a, n in d.items()) for d in axes.values())
    return "{" + ", ".join(f"{key(k)}: {{{dims}}}" for k, dims in zip(axes, inner)) + "}"
