"""The exported graph at every size of the dynamic axes the later stages run (validation's smallest and largest,
:func:`kiln.core.shapes.axis_sizes`), held to PyTorch: an exporter that fixed a size it was told varies is named here,
with the line and the fix, instead of failing deep in calibration or validation. Also the export that, where both
exporters fail, runs PyTorch at those sizes first, so that a model that takes one size says so itself."""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import onnx
import torch
from torch import nn

from kiln.core.data import DatasetSplits, Feed, Inputs, feed_for_graph, from_feed, input_names, rows, take, tensors
from kiln.core.errors import ModelError
from kiln.core.outputs import FlatModel
from kiln.core.shapes import Axes, axis_sizes, resize, shape_points
from kiln.core.text import ort_reason
from kiln.stages.export.parity import PARITY_ROWS, computes_untied, integers_over, over_tolerance, parity, parity_passes
from kiln.stages.export.pinned_sizes import BRANCH_FIX, FIXED_SIZE_HINT, pinned_at, size_branch
from kiln.stages.export.quiet import quiet_torch
from kiln.stages.export.torch_export import export_with_fallback, fixed_places, traced_value
from kiln.stages.export.torch_sizes import OwnRows, direct_point, one_name_hint, own_sizes, rows_source, torch_at

log = logging.getLogger("kiln.export")

# PyTorch's outputs at a size of the size check, by :func:`_ref_key`: run before the export, read by the check after
TorchRefs = dict[tuple[tuple[str, ...], tuple[tuple[str, int], ...]], dict[str, Any]]


def check_validated_sizes(
    model: nn.Module,
    path: Path,
    session: Any,
    data: DatasetSplits,
    names: list[str],
    axes: Axes,
    shapes: Mapping[str, list[int]],
    atol: float,
    rtol: float = 0.0,
    dynamo: str = "",
    refs: TorchRefs | None = None,
) -> None:
    """PyTorch and the exported graph at every size of the dynamic axes that the later stages run (validation's
    smallest and largest: :func:`kiln.core.shapes.axis_sizes`), beside the data's own that :func:`parity` checks,
    each output within ``atol + rtol *`` the value its error is on (:func:`within_parity`).
    A model that runs at one length only, or an exporter that fixed a size it was told varies, is named here with
    what to change, instead of failing deep in calibration or validation. ``dynamo``: why the dynamo exporter
    failed, where the graph is the TorchScript exporter's (:func:`export_with_fallback`); ``refs``: PyTorch's
    outputs at sizes :func:`export_at_sizes` already ran it at."""
    x, feed, seen = _parity_rows(data, names)
    check_sizes_of(model, path, session, x, feed, seen, axes, shapes, atol, rtol, dynamo=dynamo, refs=refs)


def check_sizes_of(
    model: nn.Module,
    path: Path,
    session: Any,
    x: Inputs,
    feed: Feed,
    seen: list[Feed],
    axes: Axes,
    shapes: Mapping[str, list[int]],
    atol: float,
    rtol: float = 0.0,
    direct: bool = False,
    dynamo: str = "",
    refs: TorchRefs | None = None,
) -> list[dict[str, int]]:
    """:func:`check_validated_sizes` on the rows ``x`` (``feed``: as the graph takes them) resized to each size,
    the sizes taken from ``shapes`` or else from ``seen`` (a row of each split: their smallest and largest; half
    of one size). ``direct``: for ``kiln export -o``, where no later stage runs a size Kiln makes: one the model
    cannot take gives way to the smallest it takes (:func:`direct_point`), and the errors speak of the example.
    Where outputs that order or count by value (indices, a length the values decide) are off on inputs Kiln padded
    with zeros, whose equal scores runtimes order apart, the graph passes if it computes the model on the inputs
    grown by their own values (:func:`computes_untied`). ``dynamo``: why the dynamo exporter failed, where the
    graph is the TorchScript exporter's, said with the error. ``refs``: PyTorch's outputs at sizes already run
    (:func:`export_at_sizes`), not run again. Returns the sizes checked (the step probe's range)."""
    whose = "the example's" if direct else "the data's"
    tie = (
        "give inputs that tie no scores (a config whose data.name gives real ones)"
        if direct
        else "validate at sizes the data has (signature.shapes) or at sizes of inputs that tie no scores"
    )
    points = _sizes_to_check(model, x, feed, seen, axes, shapes, direct)
    passed: list[dict[str, int]] = []  # the sizes the graph computed the model at, for a fix that lists some
    own_rows = OwnRows()
    for point, sized in points:
        at, inputs = ", ".join(f"{k}={v}" for k, v in point.items()), from_feed(sized, x)
        ref = (refs or {}).get(_ref_key(feed, point))
        if ref is None:
            ref = torch_at(model, inputs, point, [feed, *seen], axes, shapes, direct, own_rows)
        by_value: list[str] = []
        indices: list[str] = []
        try:
            check = parity(model, path, inputs, session, at, ref)
            over, by_value = not parity_passes(check, atol, rtol), check["by_value"]
            indices = integers_over(check, ref, atol, rtol)
        except ModelError:
            raise
        except Exception as exc:  # ONNX Runtime's own error: the graph holds the size it was exported at
            over, why = True, ort_reason(exc, 400)
        else:
            why = over_tolerance(check, atol, rtol)
        if over and (by_value or indices) and computes_untied(model, path, session, x, feed, axes, point, atol, rtol):
            log.info(
                "at %s the outputs %s differ on %s inputs padded with zeros (equal scores there, which runtimes "
                "order apart) and agree on them grown by their own values: the graph computes the model there",
                *(at, by_value or indices, whose),
            )
            passed.append(point)
            continue
        if over and by_value:
            raise ModelError(
                f"the exported graph does not compute the model at {at}, where PyTorch runs ({why}), and outputs "
                f"{by_value} have a length the values decide (NMS, a threshold): scores may tie on the inputs Kiln "
                f"made that size from {whose} (its zero padding, equal values of their own), and runtimes break ties "
                "apart (another detection kept)" + _fell_back(dynamo),
                hint=f"{tie}, or export the model before its thresholding (its raw scores and boxes) and threshold "
                "outside",
            )
        if over:
            line = pinned_at(model, take(x, slice(0, 2)), axes)  # the loop or Python number that fixed it
            named = one_name_hint([feed, *seen], axes, point, rows_source(direct))
            worked = _worked_sizes(own_sizes(feed, axes), passed)
            places = fixed_places(dynamo)
            traced = "" if line or places else traced_places(model, take(x, slice(0, 2)), path, dynamo)
            where = f"at {at}, where PyTorch runs ({why})"
            raise _fixed_size_error(where, line, indices, tie, named, dynamo, worked, places, traced)
        passed.append(point)
    return [point for point, _ in points]


def _fixed_size_error(
    where: str,
    line: str,
    indices: list[str],
    tie: str,
    named: str,
    dynamo: str,
    worked: dict[str, list[int]],
    places: str = "",
    traced: str = "",
) -> ModelError:
    """The size check's error where the graph does not compute the model ``where`` (the sizes, and the error there):
    the exporter fixed a size (at ``line`` of the user's code, where found); or, with integer outputs off
    (``indices``), equal scores they index, which runtimes order apart (``tie``: the fix for that). ``named``: the
    start of the fix where two axes may be one (:func:`one_name_hint`); ``dynamo``: why the dynamo exporter
    failed, where the graph is the TorchScript exporter's (:func:`_fell_back`, :func:`_dynamo_hint`); ``worked``:
    sizes the graph computed the model at, which the fix offers where no line of the user's code fixed the size
    (:func:`_library_fix`), with the places the dynamo exporter found fixing it (``places``: :func:`fixed_places`)
    or, where the graph is the TorchScript exporter's, those its trace read tensors as Python values at (``traced``:
    :func:`traced_places`)."""
    ties = f", or its integer outputs {indices} index scores that tie there (top-k, argmax), which runtimes order apart"
    return ModelError(
        f"the exported graph does not compute the model {where}: the exporter fixed a size that "
        f"signature.dynamic_axes makes vary{' in ' + line if line else ''}{ties if indices else ''}"
        + _fell_back(dynamo),
        hint=_dynamo_hint(dynamo)
        + (f"if {indices} are indices of tied scores, {tie}; else " if indices else "")
        + named
        + _size_fix(line, worked, places, traced),
    )


def _size_fix(line: str, worked: dict[str, list[int]], places: str = "", traced: str = "") -> str:
    """The fix for a size the exporter fixed at ``line`` of the user's code: the branch on it made unconditional
    where that line is one (:func:`size_branch`), the size kept a tensor shape otherwise, and sizes where the graph
    computes the model (``worked``) where no line of the user's was found (:func:`_library_fix`, naming ``places``,
    where the dynamo exporter found the size fixed, or ``traced``, where the TorchScript exporter's trace read
    tensors as Python values)."""
    if size_branch(line):
        return BRANCH_FIX + "; or give signature.shapes sizes on one side of the branch only"
    return FIXED_SIZE_HINT if line else _library_fix(worked, places, traced)


def _library_fix(worked: dict[str, list[int]], places: str = "", traced: str = "") -> str:
    """The fix where no line of the user's code was found fixing the size (:func:`pinned_at` cannot always tell
    one, so none is claimed not to): a library's module may have (a ``transformers`` model's ``if width % patch !=
    0:`` pad, which its user cannot edit; named by ``places``, ``modeling_funnel.py:152``, where the dynamo exporter
    found the lines; or ``traced``, ``modeling_mobilevit.py:406``, where the TorchScript exporter, whose graph it
    is, read a tensor's value or size as a Python number: the places its warning names), so sizes on the side of
    its branch where the graph computes the model (``worked``) come first, then the fix for the user's own code."""
    listed = "{" + ", ".join(f"{k}: {v}" for k, v in worked.items()) + "}"
    library = (
        f"a library's module did, at {places}, where torch.export found the size fixed (a branch on the size, or a "
        "size read as a Python number)"
        if places
        else f"a library's module may have, at {traced}, where the TorchScript exporter read a tensor's value or size "
        "as a Python number, which its graph keeps (a branch on the size, or a size computed as a number)"
        if traced
        else "a library's module may have (a branch on the size, as a pad where width % patch != 0)"
    )
    return (
        f"no line of your code was found fixing it; {library}: give signature.shapes sizes on the side of that branch "
        f"where the graph computes the model, e.g. {listed} (where it does); else, in your own code, {FIXED_SIZE_HINT}"
    )


def traced_places(model: nn.Module, example: Inputs, path: Path, dynamo: str) -> str:
    """``a.py:3, b.py:9 and 2 more``: where the TorchScript exporter's trace of ``model`` on ``example`` read tensors
    as Python values (its TracerWarnings: the places its export's warning named, the user's code or a library's),
    where the graph at ``path`` is that exporter's: the dynamo exporter failed first (``dynamo``) or was not tried (an
    opset below 18, which it does not write); empty for the dynamo exporter's graph. Traced again here, on the size
    check's error path only, so the fix names the lines its warning did."""
    opset = max(
        (o.version for o in onnx.load(str(path), load_external_data=False).opset_import if o.domain in ("", "ai.onnx")),
        default=0,
    )
    if not dynamo and opset >= 18:
        return ""
    with quiet_torch(), warnings.catch_warnings(record=True) as said:  # autograd on, as the exporter's
        warnings.simplefilter("ignore")
        warnings.simplefilter("always", torch.jit.TracerWarning)
        try:
            torch.jit.trace(FlatModel(model, example), tuple(tensors(example)), check_trace=False, strict=False)
        except Exception as exc:  # noqa: BLE001 - the places are a hint: a model the tracer refuses names none
            log.debug("tracing for the places the TorchScript exporter fixed: %s", exc)
    found = list(dict.fromkeys(place for w in said if (place := traced_value(w))))
    return ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")


def _worked_sizes(own: dict[str, int], passed: list[dict[str, int]]) -> dict[str, list[int]]:
    """Sizes of each axis to give signature.shapes where the graph computed the model: the data's own (``own``,
    which the parity check passed), with those of the points the size check passed (``passed``) where every point
    the later stages would then run (:func:`kiln.core.shapes.shape_points`) is one of those."""
    sizes = {k: sorted({v, *(p[k] for p in passed if k in p)}) for k, v in own.items()}
    if all(p == own or p in passed for p in shape_points(sizes)):
        return sizes
    return {k: [v] for k, v in own.items()}


def _fell_back(dynamo: str) -> str:
    """The end of a size check's error where the graph is the TorchScript exporter's: the dynamo exporter, whose
    graph keeps sizes symbolic, failed first (``dynamo``: why, and where in the user's code); empty otherwise."""
    return f"; this graph is the TorchScript exporter's: the dynamo exporter failed first ({dynamo})" if dynamo else ""


def _dynamo_hint(dynamo: str) -> str:
    """The start of a size check's fix where the dynamo exporter failed first at a line of the user's code that its
    error names (``dynamo``): change that code, so its graph is exported (where the failure is torch's transformer
    stack reading a mask's values, pass its causal flag there); empty otherwise."""
    named = re.search(r"\(in ([\w<>]+\(\) at [^)]+)\)$", dynamo)
    if named is None:
        return ""
    flag = re.search(r"pass ((?:tgt_)?is_causal)=True with the causal mask", dynamo)
    if flag is not None:  # torch's transformer stack reading the mask's values: its flag, not the user's line
        return (
            f"pass {flag.group(1)}=True with the causal mask (in {named.group(1)}), so that the dynamo exporter "
            "exports the model (its graph keeps sizes symbolic); else "
        )
    return (
        f"change the code the dynamo exporter failed on, in {named.group(1)}, so that it exports the model (its "
        "graph keeps sizes symbolic, where the TorchScript exporter's trace may fix them); else "
    )


def _parity_rows(data: DatasetSplits, names: list[str]) -> tuple[Inputs, Feed, list[Feed]]:
    """The held-out rows the size checks run (as the model takes them, and as a feed), and one row of each split."""
    x = take(data.val_x, slice(0, PARITY_ROWS))
    seen = [feed_for_graph(take(s, slice(0, 1)), names) for s in (data.train_x, data.val_x) if rows(s)]
    return x, feed_for_graph(x, names), seen


def _other_sizes(
    feed: Feed, seen: list[Feed], axes: Axes, shapes: Mapping[str, list[int]]
) -> list[tuple[dict[str, int], Feed]]:
    """Each shape of the dynamic axes the later stages run (:func:`kiln.core.shapes.shape_points`) but the data's
    own, with ``feed`` resized to it."""
    out = []
    for point in shape_points(axis_sizes(seen, axes, shapes)) if axes else []:
        sized = resize(feed, axes, point)
        if any(sized[n].shape != feed[n].shape for n in feed):
            out.append((point, sized))
    return out


def _sizes_to_check(
    model: nn.Module,
    x: Inputs,
    feed: Feed,
    seen: list[Feed],
    axes: Axes,
    shapes: Mapping[str, list[int]],
    direct: bool,
) -> list[tuple[dict[str, int], Feed]]:
    """:func:`_other_sizes`; for ``kiln export -o`` (``direct``) each as :func:`direct_point` moves it, once."""
    points = _other_sizes(feed, seen, axes, shapes)
    if not direct:
        return points
    out: list[tuple[dict[str, int], Feed]] = []
    for point, _ in points:
        moved = direct_point(model, x, feed, axes, point, shapes)
        if moved is not None and all(moved != p for p, _ in out):
            out.append((moved, resize(feed, axes, moved)))
    return out


def export_at_sizes(
    model: nn.Module,
    example: Inputs,
    path: Path,
    opset: int,
    data: DatasetSplits,
    axes: Mapping[str, Mapping[int, str]] | None,
    shapes: Mapping[str, list[int]],
    refs: TorchRefs | None = None,
) -> tuple[onnx.ModelProto, str]:
    """:func:`export_with_fallback` with a dynamic batch and ``axes``; where an axis varies, PyTorch runs first at
    the other sizes the later stages run (as :func:`check_validated_sizes` does): a model that takes one size (a
    shape check of its own, an axis declared on one input but not on another it multiplies) fails there with its own
    error, in a second, not after the exporters' attempts (the dynamo exporter's takes seconds to a minute before
    its graph holds the size, and the TorchScript one's op traced at that one size may fail to export). PyTorch's
    outputs there go into ``refs``, which :func:`check_validated_sizes` takes so it does not run them again."""
    if axes:
        names = input_names(model, example)
        x, feed, seen = _parity_rows(data, names)
        own_rows = OwnRows()
        for point, sized in _other_sizes(feed, seen, dict(axes), shapes):
            ref = torch_at(model, from_feed(sized, x), point, [feed, *seen], dict(axes), shapes, own_rows=own_rows)
            if refs is not None:
                refs[_ref_key(feed, point)] = ref
    return export_with_fallback(model, example, path, opset, True, axes)


def _ref_key(feed: Feed, point: Mapping[str, int]) -> tuple[tuple[str, ...], tuple[tuple[str, int], ...]]:
    """The key of PyTorch's outputs on ``feed`` resized to ``point`` in :data:`TorchRefs`: the inputs by name (the
    graph may take fewer than the model) and the sizes."""
    return tuple(feed), tuple(sorted(point.items()))


def checked_spans(feed: Feed, axes: Axes, points: list[dict[str, int]]) -> dict[str, list[int]]:
    """Each named dynamic axis -> the sizes ``kiln export -o`` held the graph to PyTorch at: the example's own
    (the parity check's) and those of the size check (``points``, as :func:`direct_point` moved them), whose
    smallest and largest bound the step probe (a size Kiln made that the model cannot take is no end of it)."""
    spans = {label: [size] for label, size in own_sizes(feed, axes).items()}
    for point in points:
        for label, size in point.items():
            spans.setdefault(label, []).append(size)
    return spans
