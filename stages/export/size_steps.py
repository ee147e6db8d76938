"""The steps of sizes a model takes on a dynamic axis (``[period, *residues]``: a U-Net's multiples of 4), found by
running PyTorch on one sample, and, given the exported graph, the sizes at which that graph gives PyTorch's outputs.
They are recorded for the engines (``axis_steps.json``, the ONNX file's metadata), which refuse a size outside them
instead of failing on it or answering it wrongly."""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable, Mapping
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from torch import nn

from kiln.core.data import DatasetSplits, Feed, Inputs, feed_for_graph, from_feed, rows, take
from kiln.core.errors import KilnError
from kiln.core.onnx_io import set_metadata
from kiln.core.records import steps_text
from kiln.core.shapes import Axes, axis_sizes, resize
from kiln.core.steps import aligned_period, sparse_steps
from kiln.core.text import short_reason
from kiln.stages.export.declaration import GRAPH_STEPS_KEY, MAX_PERIOD, SIZE_PROBES
from kiln.stages.export.parity import (
    computes_untied,
    integers_over,
    over_tolerance,
    parity,
    parity_passes,
    torch_outputs,
)
from kiln.stages.export.pinned_sizes import BRANCH_FIX, FIXED_SIZE_HINT, pinned_at, size_branch
from kiln.stages.train.stage import probe_copy

log = logging.getLogger("kiln.export")


def runs_at(
    model: nn.Module,
    feed: Feed,
    like: Inputs,
    axes: Axes,
    base: Mapping[str, int],
    label: str,
    graph: GraphAt | None = None,
    wrong: dict[int, str] | None = None,
) -> Callable[[int], bool]:
    """Whether PyTorch runs ``model`` on ``feed`` (rebuilt as ``like``) resized to ``base`` with axis ``label`` at
    a size, and, with ``graph``, the exported graph gives its outputs there (:func:`_graph_misses`): the step probes'
    question, each size asked once. ``wrong``: filled with the sizes where PyTorch runs and the graph does not, and
    why. The sizes run on a copy of ``model`` (:func:`~kiln.stages.train.stage.probe_copy`, which probes a model too
    large to hold twice itself), copied again after a size that changed its settings (:func:`_settings`): a model
    that changes itself at a size (Hugging Face's Swin shrinks its window for an image smaller than it) would
    otherwise answer every later size, and the export, changed."""
    own = _settings(model)
    copies = [probe_copy(model)]

    @cache
    def runs(size: int) -> bool:
        point = {**base, label: size}
        inputs = from_feed(resize(feed, axes, point), like)
        if _settings(copies[-1]) != own:
            copies.append(probe_copy(model))
        probed = copies[-1]
        try:
            ref = torch_outputs(probed, inputs)
        except Exception:  # the model cannot take that size
            return False
        why = _graph_misses(probed, graph, like, feed, axes, point, inputs, ref) if graph is not None else ""
        if why and wrong is not None:
            wrong[size] = why
        return not why

    return runs


def _settings(model: nn.Module) -> list[dict[str, Any]]:
    """Each submodule's plain settings (its attributes of a number, a string or a tuple: a window size, a shift):
    what a model that changes itself on a call changes, compared to tell whether a probe's copy still is the model
    (tensors are not: an eval model's forward leaves its weights and buffers as they are)."""
    plain = (bool, int, float, str, tuple)
    return [{k: v for k, v in vars(m).items() if isinstance(v, plain)} for m in model.modules()]


class GraphAt(NamedTuple):
    """The exported graph the step probe holds to PyTorch (:func:`size_steps`): ONNX Runtime's ``session`` open on
    ``path``, each output within ``atol + rtol *`` the value its error is on (:func:`within_parity`)."""

    path: Path
    session: Any
    atol: float
    rtol: float


def _graph_misses(
    model: nn.Module,
    graph: GraphAt,
    like: Inputs,
    feed: Feed,
    axes: Axes,
    point: Mapping[str, int],
    inputs: Inputs,
    ref: dict[str, np.ndarray],
) -> str:
    """Why the exported graph does not give PyTorch's outputs ``ref`` on ``inputs`` (``feed`` resized to ``point``):
    its error past the tolerance, or ONNX Runtime's; empty where it gives them. Integer outputs and outputs that
    order or count by value, off only where Kiln padded float inputs with zeros (equal scores, which runtimes order
    apart), pass where the graph computes the model on them grown by their own values (:func:`computes_untied`)."""
    path, session, atol, rtol = graph
    at = ", ".join(f"{k}={v}" for k, v in point.items())
    try:
        check = parity(model, path, inputs, session, at, ref)
    except KilnError as exc:  # another shape, NaN where PyTorch is finite: not PyTorch's outputs
        return exc.message
    except Exception as exc:  # ONNX Runtime's own error: the graph holds another size
        return "ONNX Runtime: " + short_reason(exc, 200)
    if parity_passes(check, atol, rtol):
        return ""
    tied = check["by_value"] or integers_over(check, ref, atol, rtol)
    if tied and computes_untied(model, path, session, like, feed, axes, point, atol, rtol):
        return ""
    return over_tolerance(check, atol, rtol)


def size_steps(
    model: nn.Module,
    data: DatasetSplits,
    names: list[str],
    axes: Axes,
    shapes: Mapping[str, list[int]],
    graph: GraphAt | None = None,
) -> dict[str, list[int]]:
    """Dynamic axis -> ``[period, *residues]`` where the model takes only the sizes between the smallest and largest
    the later stages run whose remainder by the period is a residue (a U-Net's height: a multiple of 4 for its
    pooling and upsampling to meet again, ``[4, 0]``; an FPN whose stride-2 convolutions round up runs at 25-32 and
    41-48, ``[16, 0, 9, ..., 15]``), found by running PyTorch on one sample: the engines record it, and servers
    refuse a size it excludes with an error naming the sizes, where the engine would fail (or answer wrongly).
    With ``graph`` (the exported one), a size counts as taken only where that graph also gives PyTorch's outputs:
    an exporter that kept the side of a branch on the size its example took (``if L % 4 != 0: pad``) leaves a graph
    that is right at some sizes only, which is warned of (:func:`_warn_graph_steps`), and the others are refused."""
    seen = [feed_for_graph(take(s, slice(0, 1)), names) for s in (data.train_x, data.val_x) if rows(s)]
    sizes = axis_sizes(seen, axes, shapes) if axes else {}
    example = take(data.val_x, slice(0, 2))
    return steps_over(model, take(example, slice(0, 1)), example, names, axes, sizes, graph)


def steps_over(
    model: nn.Module,
    x: Inputs,
    example: Inputs,
    names: list[str],
    axes: Axes,
    sizes: Mapping[str, list[int]],
    graph: GraphAt | None = None,
) -> dict[str, list[int]]:
    """:func:`size_steps` on the rows ``x`` (one, where the graph takes any batch), each axis probed from the
    smallest to the largest of its ``sizes``, the others at their smallest: the part that needs rows alone, not a
    dataset (``kiln export -o`` has its example). ``example``: the rows the export traced, for the line of the
    user's code a warning names (:func:`pinned_at`)."""
    feed = feed_for_graph(x, names)
    smallest = {label: min(v) for label, v in sizes.items() if v}
    what = "the graph computed PyTorch's outputs" if graph is not None else "PyTorch ran the model"
    out = {}
    for label, values in sizes.items():
        wrong: dict[int, str] = {}
        runs = runs_at(model, feed, x, axes, smallest, label, graph, wrong)
        span = (min(values), max(values))
        pattern = size_pattern(runs, *span, label, what)
        if pattern is not None:
            out[label] = pattern
        if pattern is not None and wrong:
            _warn_graph_steps(label, pattern, span, wrong, pinned_at(model, example, axes))
        elif pattern is not None:
            log.info("signature axis %s: the model takes sizes%s only", label, steps_text(pattern, span))
    return out


def _warn_graph_steps(
    label: str, pattern: list[int], span: tuple[int, int], wrong: Mapping[int, str], line: str
) -> None:
    """The warning where the exported graph gives PyTorch's outputs on axis ``label`` at the sizes of ``pattern``
    only (within ``span``, the validated range), and not at the sizes of ``wrong`` (each with why), where PyTorch
    runs: the cause (the exporter fixed the side of a branch on the size its example took, at ``line`` of the user's
    code where :func:`pinned_at` found it) and the fix, which lets one graph serve every size."""
    first = min(wrong)
    if not line:  # no line of the user's found (the branch may lie in a library's code, which they cannot edit)
        cause = (
            "the exporter fixed something that follows the size, a branch on it most likely (an `if L % stride "
            "!= 0:` pad in forward or in a library's module)"
        )
        fix = f"{BRANCH_FIX}; or give signature.shapes sizes on one side of it only"
    elif not size_branch(line):
        cause, fix = f"the exporter fixed a size that signature.dynamic_axes makes vary in {line}", FIXED_SIZE_HINT
    else:
        cause, fix = f"the exporter kept the side its example took of a branch on the size in {line}", BRANCH_FIX
    log.warning(
        "signature axis %s: the exported graph gives PyTorch's outputs only at %s%s: at %s=%d, where PyTorch runs, "
        "%s; %s. The engines record these sizes and refuse the others; fix: %s",
        *(label, label, steps_text(pattern, span), label, first, wrong[first], cause, fix),
    )


def size_pattern(
    runs: Callable[[int], bool], low: int, high: int, label: str = "", what: str = "PyTorch ran the model"
) -> list[int] | None:
    """``[period, *residues]`` of the sizes from ``low`` to ``high`` that ``runs``, or None where it runs at every size
    tried: the three after ``low`` and :data:`SIZE_PROBES` drawn from the two periods of :data:`MAX_PERIOD` above it
    (a fixed draw, so that a rerun finds the same; small sizes are cheap to run). Otherwise a power of two at which
    the sizes from ``low`` that run repeat is tried first at a few sizes, every size on it and every size of its
    two whole periods from ``low`` (pooling's steps, :func:`~kiln.core.steps.aligned_period`: a size off it that
    runs inside them is never refused unseen), then the two periods of :data:`MAX_PERIOD` are probed size by size
    (runs already made reused), and the shortest period at which every size runs as the one a period later is kept,
    with the remainders of the sizes that run. A range probed whole without one keeps its sizes, a step between them
    only where confirmed past it (:func:`~kiln.core.steps.sparse_steps`). ``what``: what ``runs`` asks, for the log
    line said as the probe starts with the most sizes it may run (a run each costs a model's forward)."""
    top = min(high, low + 2 * MAX_PERIOD)
    ok: dict[int, bool] = {}

    def seen(size: int) -> bool:
        if size not in ok:
            ok[size] = runs(size)
        return ok[size]

    if all(seen(size) for size in first_probes(low, top)):
        return None
    log.info(
        "signature axis %s: probing up to %d sizes from %d to %d, a run each: %s at only some of the sizes tried",
        *(label, top - low + 1, low, top, what),
    )
    seen(low)
    period = aligned_period(seen, ok, low, top, every=True)
    if period is not None:
        return [period, low % period]
    window = {size: seen(size) for size in range(low, top + 1)}
    width = top - low + 1
    period = next(
        (p for p in range(2, width // 2 + 1) if all(window[s] == window[s + p] for s in range(low, top + 1 - p))),
        None,
    )
    if period is not None:
        return [period, *sorted({size % period for size, good in window.items() if good})]
    if top == high:
        return sparse_steps(seen, window, low, top)
    log.warning(
        "signature axis %s: the model runs at some sizes from %d to %d and not at others, in no pattern of "
        "period %d or less: no sizes recorded, so a size it cannot take fails in the engine; give the sizes it "
        "takes in signature.shapes to validate those alone",
        label,
        low,
        high,
        MAX_PERIOD,
    )
    return None


def first_probes(low: int, top: int) -> list[int]:
    """The sizes :func:`size_pattern` tries first from ``low`` to ``top``: the three after ``low`` (sizes near the
    smallest: a period shows within two of them, cheaply) and :data:`SIZE_PROBES` drawn across the range (a fixed
    draw, so that a rerun finds the same)."""
    inside = range(low + 1, top + 1)
    return sorted({*inside[:3], *random.Random(0).sample(inside, min(SIZE_PROBES, len(inside)))})


def record_graph_steps(path: Path, steps: Mapping[str, list[int]]) -> None:
    """Write the axis steps the export found (:func:`steps_over`) into the ONNX file's own metadata
    (:data:`GRAPH_STEPS_KEY`), where ``kiln build FILE`` reads them: an engine built from the file alone then
    refuses the sizes its graph gets wrong, as the pipeline's engines do. Nothing where no axis has steps."""
    if steps:
        set_metadata(path, GRAPH_STEPS_KEY, json.dumps(dict(steps), sort_keys=True))
