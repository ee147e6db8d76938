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


def refusing(
    run: Callable[[Feed], dict[str, np.ndarray]], shown: str, axes: Axes, largest: Feed, inputs: str = "validation"
) -> Callable[[Feed], dict[str, np.ndarray]]:
    """``run`` (a reference in ONNX Runtime) with any failure of it raised as :func:`reference_error`."""

    def guarded(fed: Feed) -> dict[str, np.ndarray]:
        try:
            return run(fed)
        except Exception as exc:  # ONNX Runtime's own error, whatever its type: shapes the graph does not take
            raise reference_error(exc, fed, shown, axes, largest, inputs) from None

    return guarded


def reference_error(
    exc: Exception, fed: Feed, shown: str, axes: Axes, largest: Feed, inputs: str = "validation"
) -> ModelError:
    """ONNX Runtime's failure running the reference ``shown`` on ``fed`` (the ``inputs`` ones: validation's, or
    those a direct command checks on), named with the shapes fed: validation sets each named axis apart (one at its
    smallest beside the others at their largest), which a graph refuses where it takes axes named apart (an
    exporter's per-input names) at one size only. The fix names alike the axes of one size in the data
    (``largest``: every axis at its largest), the sizes the graph ran at in the export."""
    shapes = {k: f"{np.asarray(v).dtype}{list(np.shape(v))}" for k, v in fed.items()}
    return ModelError(
        f"ONNX Runtime cannot run the reference, {shown}, on the {inputs} inputs {shapes}: {short_reason(exc, 300)}",
        hint=_tie_hint(axes, largest),
    )


def _tie_hint(axes: Axes, largest: Feed) -> str:
    """The fix for a reference that refuses the validated shapes: ``axes`` (input -> {axis: name}) with the axes of
    one size in ``largest`` named alike, as the ``--set`` of signature.dynamic_axes, where that ties any; else the
    axes as they are named, to tie by hand, or sizes the graph takes."""
    named = _tied_alike(axes, largest)
    if named == {k: dict(v) for k, v in axes.items()}:
        shown = _axes_text(named) if named else "none besides the batch"
        return (
            f"name alike in signature.dynamic_axes the axes the graph takes at one size only (validated as {shown}), "
            "or give signature.shapes sizes the graph takes"
        )
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
