"""Export stage: the trained PyTorch model to ONNX with a dynamic batch axis, checked and shape-inferred,
and proven to compute the same function (ONNX Runtime vs PyTorch on held-out data)."""

from __future__ import annotations

import io
import json
import linecache
import logging
import random
import re
import sys
import traceback
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager, nullcontext, redirect_stderr, redirect_stdout
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import onnx
import torch
from torch import nn

from kiln.core import interrupt
from kiln.core.artifacts import ensure_writable
from kiln.core.compare import masks_of, max_abs_err, value_ordered, within_tolerance
from kiln.core.data import (
    SINGLE_INPUT,
    DataContractError,
    DatasetSplits,
    Feed,
    Inputs,
    as_feed,
    call,
    check_axes_name_inputs,
    feed_for_graph,
    fixed_columns,
    forward_inputs,
    from_feed,
    input_names,
    integer_ranges,
    rebuild,
    rows,
    take,
    tensors,
)
from kiln.core.errors import ConfigError, KilnError, ModelError
from kiln.core.inputs import random_inputs
from kiln.core.labels import is_mask_name, without_padding
from kiln.core.onnx_io import (
    INDEX_HINT,
    check_onnx,
    check_tensor_io,
    fixed_batch,
    free_batch,
    index_ranges,
    infer_shapes,
    io_specs,
    load_onnx,
    ort_run,
    ort_session,
    outside_index,
    rename_values,
    save_onnx,
    set_metadata,
    value_names,
)
from kiln.core.outputs import FlatModel, named_outputs
from kiln.core.records import TensorSpec, steps_text, takes_size
from kiln.core.shapes import Axes, axis_sizes, graph_axes, resize, shape_points
from kiln.core.stage import StageContext
from kiln.core.text import first_line, root_cause, short_reason
from kiln.core.user_errors import is_user_file, user_frame, where
from kiln.models.model_io import (
    dataset_for,
    load_trained,
    load_weights,
    on_random_inputs,
    random_axis_size,
    read_state_dict,
    torch_model_named,
)
from kiln.models.registry import DEFAULT_DATASET, build_model
from kiln.stages.export.batch_axes import tie_batch_axes
from kiln.stages.export.declaration import (
    AXIS_STEPS,
    DYNAMIC_SIZES,
    GRAPH_STEPS_KEY,
    INT_RANGES,
    MAX_PERIOD,
    SIZE_PROBES,
    ExportSettings,
    ExportSummary,
)
from kiln.stages.export.graph_inputs import refuse_label_outputs, warn_unused_inputs
from kiln.stages.export.other_axes import tie_other_axes
from kiln.stages.export.output_axes import name_output_axes

log = logging.getLogger("kiln.export")


def export_onnx(
    model: nn.Module,
    example: Inputs,
    path: Path,
    opset: int = 18,
    dynamic_batch: bool = True,
    dynamic_axes: Mapping[str, Mapping[int, str]] | None = None,
) -> onnx.ModelProto:
    """``torch.onnx.export`` (the dynamo exporter; the TorchScript one as a fallback), then check + infer shapes.

    ``example``: a tensor, tuple or dict of inputs (the dataset contract); ONNX input names come from the dict keys
    or the forward's parameters, output names from :func:`kiln.core.outputs.flatten_outputs`. ``dynamic_axes``:
    axes besides the batch axis that vary, named (one name ties axes of several inputs together)."""
    return export_with_fallback(model, example, path, opset, dynamic_batch, dynamic_axes)[0]


def export_with_fallback(
    model: nn.Module,
    example: Inputs,
    path: Path,
    opset: int = 18,
    dynamic_batch: bool = True,
    dynamic_axes: Mapping[str, Mapping[int, str]] | None = None,
) -> tuple[onnx.ModelProto, str]:
    """:func:`export_onnx`, and why the dynamo exporter failed where the graph is the TorchScript exporter's
    (empty where it is dynamo's): a later check that the fallback's graph fails then names the code dynamo
    refused, which is what to fix."""
    model = model.eval()
    check_axes_name_inputs(model, example, dynamic_axes)
    names = input_names(model, example)
    left_out: list[str] = []
    with torch.no_grad():
        shapes = {k: tuple(v.shape) for k, v in named_outputs(model, example, left_out).items()}
    if left_out:
        log.info("left out output %s: the model returns None there (an ONNX graph has no None outputs)", left_out)
    outputs = list(shapes)
    errors = []
    # Inputs and outputs are exported under placeholder names and get their real names after (name_io)
    ins = [f"{INPUT_PLACEHOLDER}{i}" for i in range(len(names))]
    placeholders = [f"{PLACEHOLDER}{i}" for i in range(len(outputs))]
    axes = _axes(names, dynamic_batch, dynamic_axes or {})
    # The dynamo exporter writes opset 18 at least, whatever is asked; older opsets need the TorchScript one.
    fixed: list[str] = []
    validation = ""  # where torch.distributions' argument validation made the dynamo exporter fail
    refused = ""  # why the dynamo exporter failed, where the TorchScript one then exported the graph
    for dynamo in (True, False) if opset >= 18 else (False,):
        try:
            fixed = _export(
                FlatModel(model, example),
                tuple(tensors(example)),
                ins,
                placeholders,
                path,
                opset,
                {p: axes[n] for p, n in zip(ins, names)},
                dynamo,
            )
            lost = _lost_axes(path, dict(zip(ins, names)), axes)
            if not lost:
                break
            # torch.export may specialise an axis it was told is dynamic (an nn.GRU's length), without an error
            raise ValueError(f"it fixed {', '.join(lost)}, which signature.dynamic_axes makes dynamic")
        except Exception as exc:  # the exporter raises many types; keep the message for the user
            interrupt.check()  # a Ctrl-C that landed inside the exporter's imports came out as another error
            errors.append(f"{'dynamo' if dynamo else 'torchscript'} exporter: {_reason(exc)}")
            if dynamo:
                validation, refused = _in_distributions(exc), _reason(exc)
                log.warning("dynamo exporter failed: %s; trying the TorchScript exporter", refused)
    else:
        raise ExportFailed("torch.onnx.export failed: " + " | ".join(errors), hint=_export_failed_hint(errors, opset))
    if fixed:
        refuse_traced_branch(fixed, errors, validation)
    proto = load_onnx(path)
    _restore_axis_names(proto.graph, {d for a in axes.values() for d in a.values()})
    name_io(proto.graph, dict(zip(ins, names)), outputs)
    refuse_label_outputs(proto.graph, shapes, rows(example))
    warn_unused_inputs(proto.graph)
    proto = infer_shapes(proto)
    got = max(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx"))
    if got != opset:
        log.warning("asked for opset %d, the exporter wrote opset %d", opset, got)
    save_onnx(proto, path)
    _drop_unreferenced_data(path)
    check_onnx(path, "exported model")  # from the file: the checker then needs no serialized copy of the model
    return proto, refused


# Rows the export's parity check runs: it compares the same arithmetic in two runtimes, which a few rows show as
# well as many; accuracy over the data is validation's job.
PARITY_ROWS = 8
PLACEHOLDER = "kiln_export_output_"
INPUT_PLACEHOLDER = "kiln_export_input_"


def name_io(graph: onnx.GraphProto, inputs: dict[str, str], outputs: list[str]) -> None:
    """Give the graph's inputs (``inputs``: placeholder -> name) and outputs (exported as placeholders, in order) their
    names. The exporters name internal values after their ops (``embedding``, ``cat``, ``linear``, ``add_1``); asked
    for an input or output named like one of them (a model returning ``{"embedding": ...}`` that has an
    ``nn.Embedding``, or taking ``{"cat": ...}`` and calling ``torch.cat``) the dynamo exporter wrote that name twice,
    a graph the ONNX checker rejects (not in SSA form). Such an internal value is renamed first (``cat_1``, ...)."""
    clash = sorted(set(outputs) & set(inputs.values()))
    if clash:
        raise ModelError(
            f"the model's outputs {clash} are named like its inputs; an ONNX graph cannot have both",
            hint="rename those outputs (the keys of the dict forward() returns) or the inputs",
        )
    taken = value_names(graph)
    mapping: dict[str, str] = {}
    for name in [*inputs.values(), *outputs]:
        if name in taken:
            fresh = next(f"{name}_{k}" for k in range(1, len(taken) + 2) if f"{name}_{k}" not in taken)
            mapping[name] = fresh
            taken.add(fresh)
    mapping.update(inputs)
    mapping.update(zip((o.name for o in graph.output), outputs))
    rename_values(graph, mapping)


def _axes(names: list[str], dynamic_batch: bool, extra: Mapping[str, Mapping[int, str]]) -> dict[str, dict[int, str]]:
    """Input name -> {axis: name} of every dynamic axis."""
    return {
        n: ({0: "batch"} if dynamic_batch else {}) | {int(a): str(d) for a, d in extra.get(n, {}).items()}
        for n in names
    }


def _drop_unreferenced_data(path: Path) -> None:
    """The dynamo exporter writes its weights to ``<path>.data``; once ``save_onnx`` has written the model with
    the weights inline, that file is a stale copy nothing reads (45 MB for a ResNet-18), and a later stage must
    neither ship it nor depend on it."""
    data = path.with_name(path.name + ".data")
    if not data.exists():
        return
    shell = onnx.load(str(path), load_external_data=False)
    used = {
        e.value
        for t in shell.graph.initializer
        if t.data_location == onnx.TensorProto.EXTERNAL
        for e in t.external_data
        if e.key == "location"
    }
    if data.name not in used:
        data.unlink()


def _lost_axes(path: Path, names: dict[str, str], axes: dict[str, dict[int, str]]) -> list[str]:
    """The dynamic input axes (``axes``: input -> {axis: name}) the file at ``path`` declares with a fixed size;
    ``names``: the file's input name -> the model's."""
    shell = onnx.load(str(path), load_external_data=False)
    lost = []
    for inp in shell.graph.input:
        dims = inp.type.tensor_type.shape.dim
        for axis, label in axes.get(names.get(inp.name, inp.name), {}).items():
            if axis < len(dims) and dims[axis].HasField("dim_value"):
                lost.append(f"input '{names.get(inp.name, inp.name)}' axis {axis} ({label})")
    return lost


def _reason(exc: BaseException) -> str:
    """The most specific line of an exporter error (the dynamo exporter wraps the real cause), the op its ONNX
    translation was converting (:func:`_failed_node`), and where in the user's own code it arose, where those can
    be told."""
    node = _failed_node(exc)
    op = f", converting {node.target}" if node is not None else ""
    return first_line(root_cause(exc)) + op + _user_location(exc)


def _user_location(exc: BaseException | None) -> str:
    """ " (in forward() at mine.py:12)": the innermost frame in the user's files of the error or its causes, the
    one a Dynamo error quotes "from user code", or the user's line of the graph node the dynamo exporter's ONNX
    translation failed on (:func:`_failed_node`); empty when the error is not the user's code's."""
    first = exc
    while exc is not None:
        frame = user_frame(exc)
        if frame is not None:
            return f" (in {where(frame)})"
        quoted = re.search(r'from user code:\s*File "([^"]+)", line (\d+), in (\w+)', str(exc))
        if quoted is not None and is_user_file(quoted.group(1)):
            path, line, fn = quoted.groups()
            return f" (in {fn}() at {Path(path).name}:{line})"
        exc = exc.__cause__ or exc.__context__
    return _node_location(_failed_node(first))


def _node_location(node: torch.fx.Node | None) -> str:
    """ " (in forward() at mine.py:12)": the innermost frame in the user's files of the stack a graph node was
    traced at; empty where it records none."""
    stack = str(node.meta.get("stack_trace") or "") if node is not None else ""
    traced = re.findall(r'File "([^"]+)", line (\d+), in (\w+)', stack)
    path, line, fn = next((t for t in reversed(traced) if is_user_file(t[0])), ("", "", ""))
    return f" (in {fn}() at {Path(path).name}:{line})" if path else ""


def _failed_node(exc: BaseException | None) -> torch.fx.Node | None:
    """The graph node the dynamo exporter's ONNX translation was converting when it failed (``aten.remainder.Scalar``
    with a symbolic divisor): a local of its frames in ``torch.onnx``, whose error names neither the op plainly nor
    the user's line the node records (``meta["stack_trace"]``). None where no such frame holds one."""
    while exc is not None:
        tb = exc.__traceback__
        while tb is not None:
            if f"{Path('torch', 'onnx')}" in tb.tb_frame.f_code.co_filename:
                node = next((v for v in list(tb.tb_frame.f_locals.values()) if isinstance(v, torch.fx.Node)), None)
                if node is not None:
                    return node
            tb = tb.tb_next
        exc = exc.__cause__ or exc.__context__
    return None


def _export(
    model: nn.Module,
    args: tuple[torch.Tensor, ...],
    names: list[str],
    outputs: list[str],
    path: Path,
    opset: int,
    axes: dict[str, dict[int, str]],
    dynamo: bool,
) -> list[str]:
    """Export ``model`` to ``path``; returns where the TorchScript exporter's trace turned a tensor into a Python
    value (``file:line``, the user's code or a library's: :func:`refuse_traced_branch`), empty for dynamo."""
    kw: dict[str, Any] = dict(input_names=names, output_names=outputs, opset_version=opset, dynamo=dynamo)
    if dynamo:
        # Graph rewriting is the optimize stage's job (verified, reported, reversible per pass), so export raw.
        kw["optimize"] = False
        # one Dim per name: a shared name means equal sizes (input_ids/attention_mask)
        dims = _torch_dims({d for a in axes.values() for d in a.values()})
        if any(axes.values()):
            # FlatModel takes *xs: the exporter sees them as one (tuple) argument
            kw["dynamic_shapes"] = (tuple({a: dims[d] for a, d in axes[n].items()} or None for n in names),)
    elif any(axes.values()):
        kw["dynamic_axes"] = {n: a for n, a in axes.items() if a} | {
            o: {0: "batch"} for o in outputs if any(0 in a for a in axes.values())
        }
    with _quiet_torch(), warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("ignore")
        warnings.simplefilter("always", torch.jit.TracerWarning)
        torch.onnx.export(model, args, str(path), **kw)
    return list(dict.fromkeys(place for w in said if (place := _traced_value(w))))


def _dim_names(labels: Iterable[str]) -> dict[str, str]:
    """Axis name -> the name its ``torch.export.Dim`` gets, which must be a Python identifier: an identifier as it
    is, another name with each other character as ``_`` (``seq-len`` -> ``seq_len``; ``2d`` -> ``d_2d``), kept apart
    from every other name. ``signature.dynamic_axes`` may name an axis anything; the graph's axes get those names
    back (:func:`_restore_axis_names`)."""
    labels = sorted(set(labels))
    out = {label: label for label in labels if label.isidentifier()}
    taken = set(out)
    for label in labels:
        if label in out:
            continue
        base = re.sub(r"\W", "_", label)
        base = base if base[:1].isalpha() or base[:1] == "_" else f"d_{base}"
        name = next(n for k in range(len(taken) + 1) if (n := f"{base}_{k}" if k else base) not in taken)
        out[label] = name
        taken.add(name)
    return out


def _torch_dims(labels: Iterable[str]) -> dict[str, Any]:
    """Axis name -> its ``torch.export.Dim`` (:func:`_dim_names`): sizes from 1, the batch's at most 65536."""
    names = _dim_names(labels)
    return {
        label: torch.export.Dim(name, min=1, max=65536) if label == "batch" else torch.export.Dim(name, min=1)
        for label, name in names.items()
    }


def _restore_axis_names(graph: onnx.GraphProto, labels: Iterable[str]) -> None:
    """The names ``signature.dynamic_axes`` gives its axes (``labels``) back in the graph's inputs, outputs and value
    infos where the dynamo exporter wrote the identifiers :func:`_dim_names` gave them instead (``seq_len`` for
    ``seq-len``, also inside a size it derived: ``seq_len - 6``), so the file declares the axes by the config's
    names as the TorchScript exporter's does."""
    renamed = {name: label for label, name in _dim_names(labels).items() if name != label}
    if not renamed:
        return
    found = re.compile(r"\b(" + "|".join(map(re.escape, renamed)) + r")\b")
    for value in (*graph.input, *graph.output, *graph.value_info):
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param:
                dim.dim_param = found.sub(lambda m: renamed[m.group(1)], dim.dim_param)


# The TorchScript tracer's warning where Python code reads a tensor's value (``if x.sum() > 0``, ``.item()``,
# ``int(t)``): the trace records the value the example gave as a constant
_TO_PYTHON = "Converting a tensor to a Python"
# How the dynamo exporter says a Python branch or value depends on the inputs' values
_DATA_DEPENDENT = ("data-dependent", "data dependent", "DataDependent")


def _traced_value(said: warnings.WarningMessage) -> str:
    """``file:line`` where a TracerWarning says the trace fixed a tensor's value outside torch's own code; else
    an empty string."""
    if not issubclass(said.category, torch.jit.TracerWarning) or _TO_PYTHON not in str(said.message):
        return ""
    if Path(said.filename).resolve().is_relative_to(Path(torch.__file__).resolve().parent):
        return ""
    return f"{Path(said.filename).name}:{said.lineno}"


def refuse_traced_branch(fixed: list[str], errors: list[str], validation: str = "") -> None:
    """After the dynamo exporter failed, the TorchScript exporter traced the model on its example and fixed the
    values Python code read from tensors at ``fixed``. Where dynamo failed because such a value decides a branch
    (a data-dependent guard), the graph holds only the branch the example took and computes it for every input,
    which the parity check passes whenever the data takes that branch too: an error. Where that guard is
    ``torch.distributions``' argument validation (``validation``: its place), the error says so and how to turn it
    off, which lets the dynamo exporter through. Otherwise the values may be shapes or constants: said in the log,
    with the places, since the parity check compares only the data."""
    dynamo = next((e for e in errors if e.startswith("dynamo")), "")
    named = re.search(r"\(in [\w<>]+\(\) at ([^)]+):(\d+)\)", dynamo)  # the line dynamo's error names
    at = f"{Path(named.group(1)).name}:{named.group(2)}" if named else None
    shown = [at] if at in fixed else fixed  # the branch's own line, not every shape read the trace warned of
    places = ", ".join(shown[:3]) + (f" and {len(shown) - 3} more" if len(shown) > 3 else "")
    if validation and any(k in dynamo for k in _DATA_DEPENDENT):
        built = f" (the distribution built at {at})" if at else ""
        raise ModelError(
            f"the dynamo exporter stopped at a branch on the inputs' values inside torch.distributions, at "
            f"{validation}{built}: a distribution checks its parameters' values (validate_args, on by default), "
            "a branch no graph can export; the TorchScript exporter traced only the branch its example took (the "
            f"values it fixed at {places} may be shape reads, unrelated)",
            hint="turn the check off where the model is built: torch.distributions.Distribution."
            "set_default_validate_args(False) in the model factory (or validate_args=False where the distribution is "
            "made); the dynamo exporter then exports the model",
        )
    if any(k in dynamo for k in _DATA_DEPENDENT):
        raise ModelError(
            f"the model decides a branch from its inputs' values at {places} ({dynamo}), and the TorchScript "
            "exporter traced only the branch its example took: the graph would take that branch for every input",
            hint="write the branch with tensor ops (torch.where) or torch.cond, which the dynamo exporter exports, "
            "or export the model yourself and give Kiln the file (model: {onnx: model.onnx})",
        )
    log.warning(
        "the TorchScript exporter fixed values the model's Python code reads from tensors at %s: the graph keeps "
        "the example's values there (right for shapes and constants, wrong for a branch on the inputs' values)",
        places,
    )


def _in_distributions(exc: BaseException) -> str:
    """``file:line (in function)`` of the innermost frame of ``torch.distributions.Distribution``'s value checks
    (validate_args) in the traceback of ``exc`` or its causes (an exporter that failed on one); empty where none is."""
    checks = Path(torch.distributions.distribution.__file__).resolve()
    found = ""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        for frame in traceback.extract_tb(exc.__traceback__):
            if frame.name in _VALIDATES and Path(frame.filename).resolve() == checks:
                found = f"{checks.name}:{frame.lineno} (in {frame.name})"
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return found


# Where torch.distributions.Distribution checks values: its parameters (__init__), a sample given to log_prob
_VALIDATES = ("__init__", "_validate_sample")


class ExportFailed(ModelError):
    """Both exporters failed on the model."""


def _own_sizes(feed: Mapping[str, np.ndarray], axes: Axes) -> dict[str, int]:
    """The size the data has on each named dynamic axis (its held-out rows')."""
    return {
        label: feed[name].shape[int(axis)]
        for name, dims in axes.items()
        if name in feed
        for axis, label in dims.items()
    }


def _untied_hint(feed: Mapping[str, np.ndarray], axes: Axes, point: Mapping[str, int], source: str = "the data") -> str:
    """The start of the fix where an input left out of ``signature.dynamic_axes`` has an axis the data gives the
    size of a varied one (a forecaster's ``calendar [N, 24]`` beside ``past [N, 24, F]`` whose axis 1 is ``time``):
    it may follow that axis, and then Kiln must cut it too, which only a declaration tells it; empty otherwise.
    ``source``: what ``feed`` is, in words (``kiln export -o``'s example)."""
    own = _own_sizes(feed, axes)
    said = []
    for name, array in feed.items():
        if name in axes:
            continue
        for axis in range(1, array.ndim):
            label = next((k for k in point if own.get(k) == array.shape[axis]), None)
            if label is not None:
                said.append((name, axis, label))
                break
    if not said:
        return ""
    listed = ", ".join(f"input '{n}' (axis {a}: {own[lbl]} in {source}, as {lbl})" for n, a, lbl in said)
    declared = ", ".join(f"{n}: {{{a}: {lbl}}}" for n, a, lbl in said)
    return f"if {listed} varies with it, declare that too, signature.dynamic_axes: {{{declared}}}; else "


def _one_name_hint(
    feeds: list[Mapping[str, np.ndarray]], axes: Axes, point: Mapping[str, int], source: str = "the data"
) -> str:
    """The start of the fix where ``point`` gives two axes of other names other sizes that every one of ``feeds``
    (the data's; ``source`` says whose, in words) gives one size (``{input_ids: {1: seq}, attention_mask: {1:
    len}}``, both 16 in every row): one name ties axes that must be equal, and the model's code is then not at
    fault; empty otherwise."""
    sizes = [_own_sizes(f, axes) for f in feeds]
    order = list(sizes[0]) if sizes else []
    pairs = [(a, b) for a in order for b in order[order.index(a) + 1 :] if a in point and b in point]
    tied = [(a, b) for a, b in pairs if point[a] != point[b] and all(a in s and s.get(b) == s[a] for s in sizes)]
    if not tied:
        return ""
    keep, drop = tied[0]
    declared = ", ".join(
        f"{name}: {{" + ", ".join(f"{ax}: {keep if lbl == drop else lbl}" for ax, lbl in dims.items()) + "}"
        for name, dims in axes.items()
    )
    return (
        f"axes {keep} and {drop} have one size in every row of {source} ({sizes[0][keep]}): if they must be equal, "
        f"give them one name, signature.dynamic_axes: {{{declared}}}; else "
    )


def _sizes_hint(
    point: Mapping[str, int],
    own: Mapping[str, int],
    listed: Mapping[str, list[int]],
    direct: bool = False,
    uncut: Mapping[str, list[int]] | None = None,
    split_has: bool = False,
) -> str:
    """What to do about a size the model fails at: Kiln made a smaller one by cutting the data's rows (which drops
    what the rest of a row needs: a sequence's end-of-text token, nodes a graph's edges still index),
    ``signature.shapes`` lists one (``listed``) the model does not take, or the model takes one size only.
    ``direct``: ``kiln export -o``, whose rows are its example's, and whose fix suggests no list of the example's
    sizes alone, which would check no other size. ``uncut``: sizes Kiln makes from the held-out rows without cutting
    them that the model takes (:func:`_uncut_sizes`), suggested in place of the rows' own alone, which would lock
    the engine to one size; ``split_has``: the training split's rows have the size cut to, which is where that size
    came from."""
    cut = {k: own[k] for k, v in point.items() if k in own and v < own[k] and v not in listed.get(k, ())}
    given = ", ".join(f"{k}={v}" for k, v in point.items() if v in listed.get(k, ()) and v != own.get(k, v))
    example = "{" + ", ".join(f"{k}: [{own.get(k, v)}]" for k, v in point.items()) + "}"
    if cut:
        return _cut_hint(point, cut, example, direct, uncut, split_has)
    if given:
        return (
            f"signature.shapes lists {given}: list there only sizes the model takes, or remove that axis from "
            "signature.dynamic_axes if it takes one size"
        )
    return "if the model takes one size, remove that axis from signature.dynamic_axes; else list sizes it takes in " + (
        "signature.shapes" if direct else f"signature.shapes, e.g. {example}"
    )


def _cut_hint(
    point: Mapping[str, int],
    cut: Mapping[str, int],
    example: str,
    direct: bool,
    uncut: Mapping[str, list[int]] | None,
    split_has: bool,
) -> str:
    """:func:`_sizes_hint` where Kiln cut the rows (``cut``: their own size of each axis it cut): whose rows have
    the size, and sizes to validate at that need no cutting (``uncut`` where given, else the rows' own). Where the
    training split's rows have the size (``split_has``), the model takes it, so the cutting is the cause."""
    sizes = ", ".join(f"{k}={v}" for k, v in cut.items())
    if direct:
        fix = "list sizes it takes in signature.shapes"
    elif uncut:
        listed = "{" + ", ".join(f"{k}: {v}" for k, v in uncut.items()) + "}"
        fix = (
            "validate at the held-out rows' own size and a larger one Kiln makes by repeating them, which the model "
            f"runs at, signature.shapes: {listed}"
        )
    else:
        fix = f"validate at sizes the data has, signature.shapes: {example}"
    if not split_has:
        return (
            f"Kiln made that size by cutting {_source(direct)}'s rows (its own: {sizes}), which drops what the "
            "rest of a row needs (a sequence's end token, nodes a graph's edges still index) or gives a size the "
            f"model's strides or pooling do not divide: {fix}; or remove the axis from signature.dynamic_axes if the "
            "model takes one size"
        )
    at = ", ".join(f"{k}={point[k]}" for k in cut)
    return (
        f"{at} is the training split's rows' size, but the later stages make every size from the held-out rows: "
        f"Kiln cut those (their own: {sizes}) to it, which drops what the rest of a row needs (a sequence's end "
        f"token, nodes a graph's edges still index): {fix}; or hold out rows of the smallest size, which Kiln only "
        "lengthens"
    )


def _uncut_sizes(
    model: nn.Module, like: Inputs, feed: Feed, axes: Axes, own: Mapping[str, int]
) -> dict[str, list[int]]:
    """Each axis's size in the held-out rows ``feed`` and twice it: sizes Kiln makes from them without cutting
    (:func:`kiln.core.shapes.resize` lengthens by repeating or padding), where PyTorch answers something finite at
    every shape the later stages run over them (:func:`kiln.core.shapes.shape_points`), their floats padded with
    zeros (as the export checks) and repeated (as validation and calibration grow them); empty where it does not,
    or the rows have no size on an axis."""
    sizes = {k: [v, 2 * v] for k, v in sorted(own.items()) if v > 0}
    if not sizes or len(sizes) < len(own):
        return {}
    row = {k: v[:1] for k, v in feed.items()}
    for point in shape_points(sizes):
        for repeat in (False, True):
            try:
                with warnings.catch_warnings():  # what the model warns of at a size only probed is not the user's
                    warnings.simplefilter("ignore")
                    ref = _torch_outputs(model, from_feed(resize(row, axes, point, repeat_floats=repeat), like))
            except Exception:  # noqa: BLE001 - the model cannot take that size: suggest none of these
                return {}
            if _nothing_finite(ref):
                return {}
    return sizes


def _uncut_if_cut(
    model: nn.Module, like: Inputs, point: Mapping[str, int], feeds: list[Feed], axes: Axes, direct: bool
) -> tuple[dict[str, list[int]], bool]:
    """For :func:`_sizes_hint` in a run (not ``direct``) where Kiln cut the held-out rows (``feeds[0]``) to reach
    ``point``: the sizes it makes from them uncut that the model takes (:func:`_uncut_sizes`), and whether another
    split's row (``feeds[1:]``) has ``point``'s sizes (:func:`_split_has`). Nothing is run otherwise."""
    own = _own_sizes(feeds[0], axes)
    if direct or not any(v < own.get(k, v) for k, v in point.items()):
        return {}, False
    return _uncut_sizes(model, like, feeds[0], axes, own), _split_has(point, own, feeds[1:], axes)


def _split_has(point: Mapping[str, int], own: Mapping[str, int], seen: list[Feed], axes: Axes) -> bool:
    """Whether a row of another split than the held-out rows (``own``: their sizes; ``seen``: a row of each split)
    has every size of ``point`` that Kiln made by cutting those."""
    cut = {k: v for k, v in point.items() if k in own and v < own[k]}
    return bool(cut) and any(all(_own_sizes(f, axes).get(k) == v for k, v in cut.items()) for f in seen)


@contextmanager
def _quiet_torch() -> Iterator[None]:
    """The exporter prints progress chatter and warns about optional torchvision ops, and torch.export prints the
    graph it failed on to stderr (twice) and logs the symbol it could not place: keep the user's console clean,
    the failure's own message says why (what was said goes to the debug log, which --verbose shows)."""
    quiet = [logging.getLogger(n) for n in ("torch.onnx", SHAPES_LOG)]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.ERROR)
    said = io.StringIO()
    try:
        with warnings.catch_warnings(), redirect_stdout(said), redirect_stderr(said), _no_torchscript_log():
            warnings.simplefilter("ignore")
            yield
    finally:
        for q, level in zip(quiet, levels):
            q.setLevel(level)
        if said.getvalue().strip():  # what the exporter, or the model's own prints, said meanwhile: --verbose
            log.debug("while exporting:\n%s", said.getvalue())


SHAPES_LOG = "torch.fx.experimental.symbolic_shapes"


@contextmanager
def _no_torchscript_log() -> Iterator[None]:
    """The TorchScript exporter switches its C++ log on whatever ``verbose`` says (its check reads the function
    ``_jit_is_onnx_log_enabled`` instead of calling it) and, when it fails, writes the whole TorchScript graph to
    stderr ahead of Kiln's error; its switch is a no-op for the call. Without that module (another torch): as is."""
    try:
        from torch.onnx._internal.torchscript_exporter import utils
    except ImportError:
        yield
        return
    switch = getattr(utils, "setup_onnx_logging", None)
    utils.setup_onnx_logging = lambda verbose: nullcontext()
    try:
        yield
    finally:
        if switch is not None:
            utils.setup_onnx_logging = switch


def parity(
    model: nn.Module,
    onnx_path: Path,
    x: Inputs,
    session: Any = None,
    at: str = "",
    ref: dict[str, np.ndarray] | None = None,
) -> dict[str, Any]:
    """ONNX Runtime against PyTorch on ``x``: the largest abs error over every output, and per output.
    ``session``: one already open on ``onnx_path``; ``at``: the sizes ``x`` has, for the messages; ``ref``:
    PyTorch's outputs on ``x``, where already computed."""
    if ref is None:
        ref = _torch_outputs(model, x)
    sess = session if session is not None else ort_session(onnx_path)
    _same_outputs(list(ref), [o.name for o in sess.get_outputs()], "at " + (at or f"batch {rows(x)}"), rows(x))
    feed = as_feed(x, [i.name for i in sess.get_inputs()])
    got = ort_run(sess, feed)
    # positions an attention mask marks as padding are no one's answer (kiln.core.labels.without_padding): the mask
    # on each output's own axis, by the graph's axis names (an encoder's mask is not a decoder's)
    names = lambda values: {v.name: {i: d for i, d in enumerate(v.shape) if isinstance(d, str)} for v in values}  # noqa: E731
    axes, out_axes = names(sess.get_inputs()), names(sess.get_outputs())
    ref = without_padding(feed, ref, axes, out_axes)
    answered = without_padding(feed, dict(zip(ref, got)), axes, out_axes)
    # outputs whose length the values decide (an axis 0 no input has: NMS's detections) in one order of their
    # values: ONNX Runtime's TopK orders tied scores apart from torch.topk, and Kiln's widened inputs tie them
    given = {d for dims in axes.values() for d in dims.values()}
    by_value = [o.name for o in sess.get_outputs() if o.shape and isinstance(o.shape[0], str)]
    by_value = [n for n in by_value if out_axes[n][0] not in given]
    ref, answered = value_ordered(ref, answered, by_value)
    got = [answered[n] for n in ref]
    for (name, r), g in zip(ref.items(), got):
        if g.shape != r.shape:
            raise ShapeMismatch(
                f"exported model's output '{name}' has shape {g.shape}{' at ' + at if at else ''}, PyTorch's {r.shape}",
                hint=FIXED_SIZE_HINT if at else "check the model's outputs for sizes computed outside torch",
            )
        _refuse_non_finite(name, r, g, at)
    errs = {name: max_abs_err(r, g) for (name, r), g in zip(ref.items(), got)}
    scale = {name: _scale_at_worst(r, g) for (name, r), g in zip(ref.items(), got)}
    return {
        "max_abs_err": max(errs.values()),
        "per_output": errs,
        "scale": scale,
        "samples": rows(x),
        "by_value": by_value,
    }


def _scale_at_worst(ref: np.ndarray, got: np.ndarray) -> float:
    """The magnitude of an output's value where the graph's answer is furthest from it (a mask's fill and values
    that are not finite left out: :func:`kiln.core.compare.masks_of`), the size float rounding scales with there:
    the error must be explained by the value it is on, so a lone large value (a -1e9 fill, an outlier) widens the
    tolerance of no other, and a small channel beside a large one is held to its own size. 0 for an integer
    output, compared exactly."""
    if ref.dtype.kind != "f" or ref.size == 0:
        return 0.0
    r, g = np.asarray(ref, dtype=np.float64), np.asarray(got, dtype=np.float64)
    keep = np.isfinite(r) & np.isfinite(g) & ~np.isin(r, masks_of(ref).values)
    if not keep.any():
        return 0.0
    err = np.full(r.shape, -1.0)
    err[keep] = np.abs(g[keep] - r[keep])  # the kept values only: an infinity in both would be NaN, said as a warning
    return float(np.abs(r.flat[int(np.argmax(err))]))


def within_parity(errs: Mapping[str, float], scale: Mapping[str, float], atol: float, rtol: float) -> bool:
    """Whether every output's error (``errs``) is within ``atol + rtol *`` the value it is on (``scale``:
    :func:`_scale_at_worst`): float rounding grows with the values a graph computes, so each is held to its size."""
    return all(err <= atol + rtol * scale.get(name, 0.0) for name, err in errs.items())


def parity_passes(check: Mapping[str, Any], atol: float, rtol: float) -> bool:
    """Whether a :func:`parity` result is within ``atol`` and ``rtol`` (:func:`within_parity`)."""
    return within_parity(check["per_output"], check["scale"], atol, rtol)


def require_parity(check: Mapping[str, Any], atol: float, rtol: float, where: str, advice: str = "") -> None:
    """:func:`parity_error` where a :func:`parity` result is not within ``export.parity_atol`` and
    ``export.parity_rtol`` (:func:`parity_passes`)."""
    if not parity_passes(check, atol, rtol):
        raise parity_error(check, atol, where, advice, rtol)


def _same_outputs(names: list[str], exported: list[str], at: str, batch: int) -> None:
    """The model returns the outputs the graph was exported with (``names``: PyTorch's at ``at``, ``batch`` rows).
    An output that is None on some calls and a tensor on others (it depends on the batch) has no place in a graph:
    the export left it out, or kept it, as the example it traced had it. Nor has a list with one item per sample
    (:func:`_per_sample_list`)."""
    _refuse_per_sample_list(names, exported, at, batch)
    now = [f"'{n}' a tensor" for n in names if n not in exported] + [f"'{n}' None" for n in exported if n not in names]
    if now:
        raise ModelError(
            f"the model returns output {', '.join(now)} {at}, but not on the example the graph was exported with: "
            "a None output is left out of the graph, so it must be None on every call",
            hint="return each output as a tensor on every call, or as None on every call (an absent loss)",
        )


# A list item in a flattened output's name (kiln.core.outputs.flatten_outputs): ``output_<i>`` at the top, ``.<i>``
# inside a container
_LIST_ITEM = re.compile(r"(?:^output_|\.)(\d+)(?=\.|$)")


def _list_lengths(names: list[str]) -> dict[str, int]:
    """List (its path, ``*`` for its index: ``output_*``, ``detections.*``) -> how many items ``names`` hold of it."""
    items: dict[str, set[int]] = {}
    for name in names:
        for match in _LIST_ITEM.finditer(name):
            items.setdefault(name[: match.start(1)] + "*", set()).add(int(match.group(1)))
    return {path: len(found) for path, found in items.items()}


def _per_sample_list(names: list[str], exported: list[str], batch: int) -> tuple[str, int] | None:
    """(the list's path, its length in the graph) for an output list of ``batch`` items (``names``) whose length
    in the exported graph differs: one item per sample, as torchvision's detectors return one ``{boxes, scores,
    labels}`` dict per image. None: no such list."""
    then = _list_lengths(exported)
    for path, length in _list_lengths(names).items():
        if length == batch and then.get(path, length) != length:
            return path, then[path]
    return None


def _refuse_per_sample_list(names: list[str], exported: list[str], at: str, batch: int) -> None:
    """A ModelError for an output list whose length follows the batch (:func:`_per_sample_list`): a graph's outputs
    are a fixed set, so it holds as many items as the example it traced had samples."""
    found = _per_sample_list(names, exported, batch)
    if found is None:
        return
    path, traced = found
    raise ModelError(
        f"the model returns a list of outputs whose length follows the batch ({path.replace('*', '<i>')}: {batch} "
        f"items {at}, {traced} on the example the graph was exported with), which is not supported: a graph has a "
        "fixed number of outputs",
        hint="return flat tensors over the whole batch, each row with the index of the sample it belongs to: e.g. "
        "detections as boxes [K, 4], scores [K], labels [K] and an image index [K]",
    )


class ShapeMismatch(ModelError):
    """An output of the exported graph has another shape than PyTorch's: at a size other than the traced one, the
    sign of a size the export fixed (:func:`batch_parity` tells it from other parity errors)."""


def _torch_outputs(model: nn.Module, x: Inputs) -> dict[str, np.ndarray]:
    with torch.no_grad():
        return {k: v.numpy() for k, v in named_outputs(model, x).items()}


# Two calls on the same inputs differ by more than this share of the output's largest value (or this much, for
# outputs near zero) only where forward draws random numbers: arithmetic on one machine repeats itself exactly.
_RANDOM_SHARE, _RANDOM_FLOOR = 1e-3, 1e-5

RANDOM_HINT = (
    "draw random numbers only in training (`if self.training:`; F.dropout(x, p, training=self.training)), and "
    "return the deterministic value at inference (a VAE's mean, mu): engines are checked by comparing their "
    "outputs with the model's, which draws of their own make impossible"
)


def warn_wide_inputs(model: nn.Module, x: Inputs) -> None:
    """Say which float64 inputs a model of float32 weights is given: the graph keeps the data's dtype at its inputs,
    so every engine and every served request would take twice the bytes of float32 for a model that computes in
    float32 (numpy's default dtype is float64; a model that casts its inputs runs fine on them)."""
    weights = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if weights != {torch.float32}:
        return
    wide = [n for n, t in zip(input_names(model, x), tensors(x)) if t.dtype == torch.float64]
    if wide:
        log.warning(
            "inputs %s are float64 and the model's weights float32: the engines would take float64 inputs (twice "
            "the bytes of float32 per request); give float32 from the data function (x.float()) unless the model "
            "needs float64",
            wide,
        )


def refuse_random(model: nn.Module, x: Inputs) -> None:
    """A model that answers the same inputs differently from call to call in eval mode is an error naming why,
    before the export: its export parity, the optimizer's safety net and validation would each fail on it, or read
    it as a model whose rows depend on their batch, and blame something else. Why: buffers forward updates (a state
    kept from call to call), inputs it changes in place, or else random draws (``torch.randn_like`` in a VAE's
    forward, ``F.dropout(x, p, training=True)``). Two forwards of the export's example rows, each on a copy of them
    (the data is not changed)."""
    copy = lambda: rebuild(x, [t.clone() for t in tensors(x)])  # noqa: E731
    given = copy()
    first = _torch_outputs(model, given)
    if not all(_same(a, b) for a, b in zip(tensors(given), tensors(x))):
        raise ModelError(
            "the model's forward changes its inputs in place (x.mul_(...), x /= 255): the export, the parity check "
            "and validation would each see other inputs than the data's",
            hint="compute on new tensors (x = x / 255), not in place on the inputs",
        )
    buffers = {k: b.clone() for k, b in model.named_buffers()}
    second = _torch_outputs(model, copy())
    moved = _moved_output(first, second)
    if moved is None:
        return
    said = f"the model answers the same inputs differently from call to call in eval mode ({moved})"
    updated = [k for k, b in model.named_buffers() if k in buffers and not _same(b, buffers[k])]
    if updated:
        raise ModelError(
            f"{said}: its forward updates buffers ({', '.join(updated[:3])}{', ...' if len(updated) > 3 else ''}), a "
            "state kept from call to call",
            hint="update state only in training (`if self.training:`), or pass it in and return it as tensors: an "
            "engine keeps no state between calls",
        )
    raise ModelError(
        f"{said}: its forward draws random numbers (torch.randn_like, torch.rand, F.dropout with training=True)",
        hint=RANDOM_HINT,
    )


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal tensors, NaN equal to NaN."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(torch.equal(a, b) or (a.is_floating_point() and torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)))


def _moved_output(first: dict[str, np.ndarray], second: dict[str, np.ndarray]) -> str | None:
    """The first output that differs between two calls beyond arithmetic's repetition, in words; None if none."""
    for name, a in first.items():
        b = second[name]
        if a.shape != b.shape:
            return f"output '{name}': shape {a.shape}, then {b.shape}"
        if a.dtype.kind != "f":
            if not np.array_equal(a, b):
                return f"output '{name}': {int(np.sum(a != b))} of {a.size} values"
            continue
        err = max_abs_err(a, b)
        finite = np.abs(a[np.isfinite(a)])
        if err > max(_RANDOM_FLOOR, _RANDOM_SHARE * (float(finite.max()) if finite.size else 0.0)):
            return f"output '{name}': by up to {err:.3g}"
    return None


def _refuse_non_finite(name: str, ref: np.ndarray, got: np.ndarray, at: str = "") -> None:
    """NaN or infinity in the graph's answer where PyTorch's is finite is its own error, named with the samples it
    hits: as an error size it would read as NaN, which no tolerance catches and no other cause explains."""
    if got.dtype.kind != "f" or got.ndim == 0 or got.size == 0:
        return
    bad = ~np.isfinite(got) & np.isfinite(ref)
    hit = np.flatnonzero(bad.reshape(len(bad), -1).any(axis=1))
    if hit.size:
        raise ModelError(
            f"the exported graph answers {hit.size} of {len(bad)} samples with NaN or infinity in output '{name}'"
            f"{' at ' + at if at else ''} where PyTorch's are finite (sample {hit[0]} first)",
            hint="find what those samples share: a row whose attention keys are all masked is finite in PyTorch's "
            "attention and NaN in the exported Softmax; keep one key unmasked per sample, or mask those rows' "
            "outputs after the model",
        )


FIXED_SIZE_HINT = (
    "keep sizes in forward as tensor shapes (x.shape[1]), not Python ints (int(x.shape[1]), a length kept from "
    "__init__); a Python loop over a dynamic axis (for t in range(x.shape[1])) is unrolled to the export's size: "
    "write it with tensor ops over the whole axis (cumsum, a vectorised scan); or remove that axis from "
    "signature.dynamic_axes if the model takes one size"
)
# The fix where the line the exporter fixed a size at is an ``if`` on it (:func:`_size_branch`): the graph holds the
# branch its example took, so each side's sizes need a graph of their own, or the branch must go
BRANCH_FIX = (
    "make the branch on the size unconditional, so that one graph serves every size: compute what it adds as a "
    "tensor expression that is 0 where nothing is needed (pad = (stride - L % stride) % stride, padding by 0 where "
    "L is a multiple), not under an if"
)


def _export_failed_hint(errors: list[str], opset: int) -> str:
    """The fix where both exporters failed: a later opset where the exporter names the one its op came in
    (``Support for this operator was added in version 20``: ``AffineGrid``, ``GridSample``'s modes), else an op ONNX
    may not express."""
    versions = [int(v) for e in errors for v in re.findall(r"added in (?:opset )?version (\d+)", e)]
    later = max((v for v in versions if v > opset), default=None)
    if later is not None:
        return f"export at the opset that has the op: --set export.opset={later} (the config's export.opset)"
    return "the model may use an op ONNX cannot express; see the message above"


def batch_parity(
    model: nn.Module, path: Path, example: Inputs, x: Inputs, atol: float, session: Any = None, rtol: float = 0.0
) -> dict[str, Any]:
    """:func:`parity` on ``x``, whose batch differs from ``example``'s, the rows the graph was traced with (the first
    rows of ``x``). A graph that fails at ``x`` (ONNX Runtime refuses it, an output of another shape, or an error
    over the tolerance, ``atol + rtol *`` the value each output's error is on, where the traced rows come out otherwise
    within ``x`` than alone) but computes ``example`` within it holds the traced batch (Swin's
    ``B = int(windows.shape[0] / n)``): a ModelError says so, and where, instead of an ONNX Runtime traceback or
    advice to raise the tolerance. Otherwise the check at ``x``, held to the tolerance by the caller; the traced
    batch runs only when ``x`` fails, so a good graph costs one run."""
    at = f"batch {rows(x)}"
    try:
        ref = _torch_outputs(model, x)
    except Exception as exc:  # PyTorch itself: the model takes only some batch sizes
        raise ModelError(
            f"the model fails at {at} in PyTorch: {_reason(exc)}",
            hint="make forward take any batch size: the export's batch axis is dynamic",
        ) from None
    check, why = _parity_or_why(model, path, x, session, ref)
    if check is not None and (parity_passes(check, atol, rtol) or rows(x) == rows(example)):
        return check
    traced, _ = _parity_or_why(model, path, example, session) if rows(x) != rows(example) else (None, "")
    # over the tolerance at x only: the batch's doing if the graph gives the traced rows other values within x than
    # alone (a graph that is merely inexact, worst on rows past the traced ones, gives them the same values)
    moved = check is None or not within_parity(_rows_move(path, session, example, x), check["scale"], atol, rtol)
    if traced is not None and parity_passes(traced, atol, rtol) and moved:
        line = _batch_pinned_at(model, example)
        raise ModelError(
            f"the exported graph depends on the batch size it was traced at ({at}: {why}; batch {rows(example)}: "
            f"max abs error {traced['max_abs_err']:.3g}): forward computes a size as a Python int or float from a "
            f"tensor's shape (e.g. int(x.shape[0] / n)){' in ' + line if line else ''}",
            hint=f"compute {'the size in ' + line if line else 'sizes from the batch'} {BATCH_FIXED_HINT}",
        )
    if check is None:  # not the batch's doing: the traced batch fails too
        raise ModelError(
            f"ONNX Runtime cannot run the exported graph at {at}: {why}",
            hint="the model may use an op ONNX Runtime runs differently from PyTorch; see the message above",
        )
    return check


def _rows_move(path: Path, session: Any, example: Inputs, x: Inputs) -> dict[str, float]:
    """Output -> how far the graph's outputs for ``example``'s rows, the first of ``x``, differ between a run on
    ``x`` and a run on ``example`` alone (outputs whose rows are the samples): 0 for a graph that does not depend on
    its batch."""
    sess = session if session is not None else ort_session(path)
    names = [i.name for i in sess.get_inputs()]
    whole, alone = ort_run(sess, as_feed(x, names)), ort_run(sess, as_feed(example, names))
    n = rows(example)
    outputs = [o.name for o in sess.get_outputs()]
    same = [
        (o, w, a) for o, w, a in zip(outputs, whole, alone) if w.ndim and w.shape[1:] == a.shape[1:] and len(a) == n
    ]
    return {o: max_abs_err(w[:n], a) for o, w, a in same}


def _parity_or_why(
    model: nn.Module, path: Path, x: Inputs, session: Any, ref: dict[str, np.ndarray] | None = None
) -> tuple[dict[str, Any] | None, str]:
    """:func:`parity` and its error in words; or None and why the graph cannot compute ``x`` (ONNX Runtime's
    error, an output of another shape). Other errors of Kiln's (NaN where PyTorch is finite) pass through."""
    try:
        check = parity(model, path, x, session, ref=ref)
    except ShapeMismatch as exc:
        return None, exc.message
    except KilnError:
        raise
    except Exception as exc:  # ONNX Runtime's own error: a node that takes the traced batch only
        return None, "ONNX Runtime: " + short_reason(exc, 200)
    return check, f"max abs error {check['max_abs_err']:.3g}"


BATCH_FIXED_HINT = (
    "with tensor ops or // on the shape (x.shape[0] // n, not int(x.shape[0] / n)), or pass -1 for the batch axis "
    "to reshape/view"
)
_GUARD = re.compile(r"\bEq\(.*\[guard added\] \((.+?):(\d+) in (\w+)\)")
# a branch on a remainder its example took the other side of (``if L % 4 != 0:`` at L=45): torch guards it unequal
_MOD_GUARD = re.compile(r"\bNe\(Mod\(.*\[guard added\] \((.+?):(\d+) in (\w+)\)")


def _batch_pinned_at(model: nn.Module, example: Inputs) -> str:
    """``window_reverse() at swin.py:13 (B = int(...))``: where in the user's code torch.export, tracing ``model``
    with a dynamic batch, pinned the batch to the example's (:func:`_pinned_at`)."""
    return _pinned_at(model, example, {name: {0: "batch"} for name in input_names(model, example)})


def _pinned_at(model: nn.Module, example: Inputs, axes: Mapping[str, Mapping[int, str]]) -> str:
    """``forward() at ssm.py:24 (for t in range(l):)``: where in the user's code torch.export, tracing ``model``
    with ``axes`` (input -> {axis: name}) dynamic, pinned one to the example's size (a Python loop over it, a size
    computed as a Python number, a branch on it); empty where it cannot be told. Only torch's symbolic-shapes log
    says where (its first equality guard placed from a user's file, else its first on a remainder being unequal), so
    it is read, on error paths only; a torch that words it otherwise leaves the line unnamed."""
    said: list[str] = []
    catch = logging.Handler()
    catch.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    shapes = logging.getLogger(SHAPES_LOG)
    labels = {label for dims in axes.values() for label in dims.values()}
    args = tuple(tensors(example))
    with _quiet_torch():
        saved = shapes.level, shapes.propagate, shapes.handlers
        shapes.setLevel(logging.INFO)  # torch's own handler on it writes to the terminal: only ``catch`` hears
        shapes.propagate, shapes.handlers = False, [catch]
        try:
            made, names = _torch_dims(labels), input_names(model, example)
            dims = (tuple({int(a): made[d] for a, d in axes.get(n, {}).items()} or None for n in names),)
            torch.export.export(FlatModel(model, example), args, dynamic_shapes=dims, strict=False)
        except Exception as exc:  # noqa: BLE001 - expected: a size is pinned; the guard's log line says where
            log.debug("torch.export with dynamic axes %s: %s", sorted(labels), first_line(exc))
        finally:
            shapes.setLevel(saved[0])
            shapes.propagate, shapes.handlers = saved[1:]
    files = {f for m in list(sys.modules.values()) if isinstance(f := getattr(m, "__file__", None), str)}
    for found in filter(None, [*map(_GUARD.search, said), *map(_MOD_GUARD.search, said)]):
        short, lineno, fn = found.groups()
        path = next((f for f in files if f.endswith(short) and is_user_file(f)), None)
        if path is not None:
            code = linecache.getline(path, int(lineno)).strip()
            return where(traceback.FrameSummary(path, int(lineno), fn)) + (f" ({code})" if code else "")
    return ""


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
) -> None:
    """PyTorch and the exported graph at every size of the dynamic axes that the later stages run (validation's
    smallest and largest: :func:`kiln.core.shapes.axis_sizes`), beside the data's own that :func:`parity` checks,
    each output within ``atol + rtol *`` the value its error is on (:func:`within_parity`).
    A model that runs at one length only, or an exporter that fixed a size it was told varies, is named here with
    what to change, instead of failing deep in calibration or validation. ``dynamo``: why the dynamo exporter
    failed, where the graph is the TorchScript exporter's (:func:`export_with_fallback`)."""
    x, feed, seen = _parity_rows(data, names)
    check_sizes_of(model, path, session, x, feed, seen, axes, shapes, atol, rtol, dynamo=dynamo)


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
) -> list[dict[str, int]]:
    """:func:`check_validated_sizes` on the rows ``x`` (``feed``: as the graph takes them) resized to each size,
    the sizes taken from ``shapes`` or else from ``seen`` (a row of each split: their smallest and largest; half
    of one size). ``direct``: for ``kiln export -o``, where no later stage runs a size Kiln makes: one the model
    cannot take gives way to the smallest it takes (:func:`_direct_point`), and the errors speak of the example.
    Where outputs that order or count by value (indices, a length the values decide) are off on inputs Kiln padded
    with zeros, whose equal scores runtimes order apart, the graph passes if it computes the model on the inputs
    grown by their own values (:func:`_computes_untied`). ``dynamo``: why the dynamo exporter failed, where the
    graph is the TorchScript exporter's, said with the error. Returns the sizes checked (the step probe's range)."""
    whose = "the example's" if direct else "the data's"
    tie = (
        "give inputs that tie no scores (a config whose data.name gives real ones)"
        if direct
        else "validate at sizes the data has (signature.shapes) or at sizes of inputs that tie no scores"
    )
    points = _sizes_to_check(model, x, feed, seen, axes, shapes, direct)
    for point, sized in points:
        at, inputs = ", ".join(f"{k}={v}" for k, v in point.items()), from_feed(sized, x)
        ref = _torch_at(model, inputs, point, [feed, *seen], axes, shapes, direct)
        by_value: list[str] = []
        indices: list[str] = []
        try:
            check = parity(model, path, inputs, session, at, ref)
            over, by_value = not parity_passes(check, atol, rtol), check["by_value"]
            indices = _integers_over(check, ref, atol, rtol)
        except ModelError:
            raise
        except Exception as exc:  # ONNX Runtime's own error: the graph holds the size it was exported at
            over, why = True, first_line(exc)
        else:
            why = _over_tolerance(check, atol, rtol)
        if over and (by_value or indices) and _computes_untied(model, path, session, x, feed, axes, point, atol, rtol):
            log.info(
                "at %s the outputs %s differ on %s inputs padded with zeros (equal scores there, which runtimes "
                "order apart) and agree on them grown by their own values: the graph computes the model there",
                *(at, by_value or indices, whose),
            )
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
            line = _pinned_at(model, take(x, slice(0, 2)), axes)  # the loop or Python number that fixed it
            named = _one_name_hint([feed, *seen], axes, point, _source(direct))
            raise _fixed_size_error(f"at {at}, where PyTorch runs ({why})", line, indices, tie, named, dynamo)
    return [point for point, _ in points]


def _fixed_size_error(where: str, line: str, indices: list[str], tie: str, named: str, dynamo: str) -> ModelError:
    """The size check's error where the graph does not compute the model ``where`` (the sizes, and the error there):
    the exporter fixed a size (at ``line`` of the user's code, where found); or, with integer outputs off
    (``indices``), equal scores they index, which runtimes order apart (``tie``: the fix for that). ``named``: the
    start of the fix where two axes may be one (:func:`_one_name_hint`); ``dynamo``: why the dynamo exporter
    failed, where the graph is the TorchScript exporter's (:func:`_fell_back`, :func:`_dynamo_hint`)."""
    ties = f", or its integer outputs {indices} index scores that tie there (top-k, argmax), which runtimes order apart"
    return ModelError(
        f"the exported graph does not compute the model {where}: the exporter fixed a size that "
        f"signature.dynamic_axes makes vary{' in ' + line if line else ''}{ties if indices else ''}"
        + _fell_back(dynamo),
        hint=_dynamo_hint(dynamo)
        + (f"if {indices} are indices of tied scores, {tie}; else " if indices else "")
        + named
        + (
            BRANCH_FIX + "; or give signature.shapes sizes on one side of the branch only"
            if _size_branch(line)
            else FIXED_SIZE_HINT
        ),
    )


def _size_branch(line: str) -> bool:
    """Whether the user's code :func:`_pinned_at` names (``forward() at m.py:44 (if L % self.stride != 0:)``) is an
    ``if`` statement on the size: the graph then holds the side of the branch its example took, which no fix of how
    the size is read mends. A conditional expression (``a if flag else b``) may test something else than the size
    that line reads, so it is not one."""
    return re.search(r":\d+ \((?:el)?if\b.*\)$", line) is not None


def _integers_over(check: Mapping[str, Any], ref: Mapping[str, np.ndarray], atol: float, rtol: float) -> list[str]:
    """The integer outputs of a :func:`parity` result past the tolerance: indices (``torch.topk``'s, an argmax),
    which pick one of equal scores as each runtime orders them."""
    per, scale = check["per_output"], check["scale"]
    return [n for n, r in ref.items() if r.dtype.kind in "iub" and not within_parity({n: per[n]}, scale, atol, rtol)]


def _computes_untied(
    model: nn.Module,
    path: Path,
    session: Any,
    like: Inputs,
    feed: Feed,
    axes: Axes,
    point: Mapping[str, int],
    atol: float,
    rtol: float,
) -> bool:
    """Whether the graph computes the model at ``point`` on ``feed``'s float inputs grown by repeating their own
    values, each copy shifted so no value repeats (:func:`kiln.core.shapes.resize`, as validation grows them), where
    the size check padded them with zeros: a constant region, on which a detector's scores tie. The copies are
    shifted up, then down: a score that falls as the input rises peaks in the data's own copy one way and in a later
    copy the other, where a graph that fixed the data's size is wrong; it passes only where both agree. False where
    both grow the inputs alike, or the model or the graph fails on them."""
    padded = resize(feed, axes, point)
    for sign in (1, -1):
        grown = resize(feed, axes, point, repeat_floats=True, step_sign=sign)
        if all(np.array_equal(grown[n], padded[n]) for n in grown):
            return False
        if not _computes_on(model, path, session, from_feed(grown, like), atol, rtol):
            return False
    return True


def _computes_on(model: nn.Module, path: Path, session: Any, inputs: Inputs, atol: float, rtol: float) -> bool:
    """Whether the graph's outputs on ``inputs`` are within the tolerance of PyTorch's; False where either fails."""
    try:
        return parity_passes(parity(model, path, inputs, session, ref=_torch_outputs(model, inputs)), atol, rtol)
    except Exception:  # noqa: BLE001 - the model or the graph cannot take them: no evidence the graph is right
        return False


def _fell_back(dynamo: str) -> str:
    """The end of a size check's error where the graph is the TorchScript exporter's: the dynamo exporter, whose
    graph keeps sizes symbolic, failed first (``dynamo``: why, and where in the user's code); empty otherwise."""
    return f"; this graph is the TorchScript exporter's: the dynamo exporter failed first ({dynamo})" if dynamo else ""


def _dynamo_hint(dynamo: str) -> str:
    """The start of a size check's fix where the dynamo exporter failed first at a line of the user's code that its
    error names (``dynamo``): change that code, so its graph is exported; empty otherwise."""
    named = re.search(r"\(in ([\w<>]+\(\) at [^)]+)\)$", dynamo)
    if named is None:
        return ""
    return (
        f"change the code the dynamo exporter failed on, in {named.group(1)}, so that it exports the model (its "
        "graph keeps sizes symbolic, where the TorchScript exporter's trace may fix them); else "
    )


def _source(direct: bool) -> str:
    """What the rows the size checks resize are, in words: the data's, or ``kiln export -o``'s example."""
    return "the example" if direct else "the data"


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
    """:func:`_other_sizes`; for ``kiln export -o`` (``direct``) each as :func:`_direct_point` moves it, once."""
    points = _other_sizes(feed, seen, axes, shapes)
    if not direct:
        return points
    out: list[tuple[dict[str, int], Feed]] = []
    for point, _ in points:
        moved = _direct_point(model, x, feed, axes, point, shapes)
        if moved is not None and all(moved != p for p, _ in out):
            out.append((moved, resize(feed, axes, moved)))
    return out


def _direct_point(
    model: nn.Module, like: Inputs, feed: Feed, axes: Axes, point: Mapping[str, int], listed: Mapping[str, list[int]]
) -> dict[str, int] | None:
    """The sizes ``kiln export -o`` checks for ``point``. A size Kiln made there (half the example's, not one
    ``signature.shapes`` lists) where PyTorch fails, or answers nothing finite, on a row of ``feed`` says nothing of
    the graph: it gives way to the smallest size from it up that PyTorch takes (a convolution of kernel 7 without
    padding takes 7 and more), or, where none below the example's does, to the example's own, which the parity
    check ran; said in the log either way. None where no axis then differs from the example's."""
    own = _own_sizes(feed, axes)
    made = [k for k, v in point.items() if k in own and v < own[k] and v not in listed.get(k, ())]
    why = _why_not_at(model, {k: v[:1] for k, v in feed.items()}, like, axes)
    reason = why(point) if made else ""
    if not reason:
        return dict(point)
    moved, base = dict(point), {**point, **{k: own[k] for k in made}}
    for label in made:
        sizes = range(point[label], own[label])
        moved[label] = next((s for s in sizes if not why({**base, label: s})), own[label])
        _say_moved(label, point[label], moved[label], own[label], reason)
    return None if all(v == own.get(k, v) for k, v in moved.items()) else moved


def _say_moved(label: str, made: int, size: int, own: int, reason: str) -> None:
    """The log line of :func:`_direct_point` for one axis: the size checked in place of the one Kiln made."""
    if size == made:
        return
    if size < own:
        log.info(
            "signature axis %s: the smallest size from %d the model takes is %d (at %d: %s): the graph is checked "
            "at %s=%d in place of %d",
            *(label, made, size, made, reason, label, size, made),
        )
        return
    log.warning(
        "signature axis %s: the model takes no size from %d up to the example's, %d (at %d: %s): the graph is "
        "checked at %s=%d alone; list in signature.shapes larger sizes it takes to check it there",
        *(label, made, own, made, reason, label, own),
    )


def _why_not_at(model: nn.Module, feed: Feed, like: Inputs, axes: Axes) -> Callable[[Mapping[str, int]], str]:
    """Why PyTorch's ``model`` on ``feed`` (rebuilt as ``like``) resized to a point leaves nothing to compare
    there: its error, or an output NaN or infinite at every value; empty where it does not. Each point asked
    once."""

    @cache
    def why(point: tuple[tuple[str, int], ...]) -> str:
        try:
            with warnings.catch_warnings():  # what the model warns of at a size only probed is not the user's run's
                warnings.simplefilter("ignore")
                ref = _torch_outputs(model, from_feed(resize(feed, axes, dict(point)), like))
        except Exception as exc:  # the model cannot take that size
            return _reason(exc)
        empty = _nothing_finite(ref)
        return f"output '{empty[0]}' is NaN or infinite at every value" if empty else ""

    return lambda point: why(tuple(sorted(point.items())))


def _torch_at(
    model: nn.Module,
    inputs: Inputs,
    point: Mapping[str, int],
    feeds: list[Feed],
    axes: Axes,
    listed: Mapping[str, list[int]],
    direct: bool = False,
) -> dict[str, np.ndarray]:
    """PyTorch's outputs at ``point`` (``feeds``: the data's, first the rows resized; ``listed``: the sizes
    ``signature.shapes`` gives; ``direct``: ``kiln export -o``'s example, not data); an error naming the size and
    what to change where the model itself fails there, or where an output of it holds no finite value there
    (:func:`_nothing_finite_error`; :func:`_padded_to_nothing` where Kiln's zero padding is what gives that)."""
    at = ", ".join(f"{k}={v}" for k, v in point.items())
    own = _own_sizes(feeds[0], axes)
    try:
        ref = _torch_outputs(model, inputs)
    except Exception as exc:
        steps = _steps_hint(model, inputs, point, feeds[0], axes, listed)
        runs = "a size the export checks" if direct else "a size the later stages run it at"
        raise ModelError(
            f"the model fails at {at}, {runs} since signature.dynamic_axes makes that axis vary: {_reason(exc)}",
            hint=steps
            or _one_name_hint(feeds, axes, point, _source(direct))
            + _untied_hint(feeds[0], axes, point, _source(direct))
            + _sizes_hint(point, own, listed, direct, *_uncut_if_cut(model, inputs, point, feeds, axes, direct)),
        ) from None
    empty = _nothing_finite(ref)
    if empty and _zeros_give_it(model, inputs, point, feeds[0], axes):
        raise _padded_to_nothing(empty[0], point, own, direct)
    if empty:
        raise _nothing_finite_error(empty[0], point, own, listed, direct)
    return ref


def _nothing_finite(ref: Mapping[str, np.ndarray]) -> list[str]:
    """The float outputs of ``ref`` that are NaN or infinite at every value of every row (``exp`` of a sum that
    grows with the length overflows float32): the graph's NaN there equals PyTorch's, so nothing in them would be
    compared and the parity check would pass with an error of 0. An output with finite values beside its
    infinities (-inf at masked positions) is compared as usual."""
    return [n for n, r in ref.items() if r.dtype.kind == "f" and r.size and not np.isfinite(r).any()]


def _nothing_finite_error(
    name: str, point: Mapping[str, int], own: Mapping[str, int], listed: Mapping[str, list[int]], direct: bool
) -> ModelError:
    """The ModelError where output ``name`` of PyTorch's is nowhere finite at ``point``: at a size the later stages
    run, the engines would answer NaN there and the size be recorded as validated. The sizes the fix suggests are
    ``listed`` (``signature.shapes``) and the data's (``own``), the failing one left out of the axes that differ
    from the data's (those at fault) only. ``direct``: ``kiln export -o``, whose fix suggests no list of the
    example's sizes alone, which would check no other size."""
    at = ", ".join(f"{k}={v}" for k, v in point.items())
    keep = {
        k: sorted({*listed.get(k, []), own.get(k, v)} - ({v} if v != own.get(k, v) else set()))
        for k, v in point.items()
    }
    sizes = "{" + ", ".join(f"{k}: {v}" for k, v in keep.items()) + "}"
    if not direct:
        first = f"validate at sizes it takes, signature.shapes: {sizes}"
    elif any(s != own.get(k) for k, v in keep.items() for s in v):
        first = f"list sizes where it is finite in signature.shapes, e.g. {sizes}"
    else:
        first = "list sizes where it is finite in signature.shapes"
    return ModelError(
        f"the model's output '{name}' is NaN or infinite at every value at {at}: it overflows (or divides by "
        "zero) at this size, so nothing there can be compared",
        hint=f"{first}; or compute in a form that stays finite there (in log space, or with the running maximum "
        "subtracted before exp)",
    )


def _zeros_give_it(model: nn.Module, like: Inputs, point: Mapping[str, int], feed: Feed, axes: Axes) -> bool:
    """Whether ``feed`` reached ``point`` by padding its float inputs with zeros (:func:`kiln.core.shapes.resize`
    repeats a float input's values only when asked) and PyTorch, given those values repeated to the same sizes
    instead, answers a finite value in every output: then the zeros Kiln added, not the model, leave nothing
    finite there (0/0 where a row is normalised)."""
    padded, repeated = resize(feed, axes, point), resize(feed, axes, point, repeat_floats=True)
    if all(np.array_equal(padded[n], repeated[n]) for n in padded):
        return False
    try:
        return not _nothing_finite(_torch_outputs(model, from_feed(repeated, like)))
    except Exception:  # the model takes no repeated values either: not the padding's doing
        return False


def _padded_to_nothing(name: str, point: Mapping[str, int], own: Mapping[str, int], direct: bool) -> ModelError:
    """The ModelError where output ``name`` is nowhere finite at ``point`` on inputs Kiln lengthened with zeros
    only (:func:`_zeros_give_it`): the fix is inputs of that length, or sizes no longer than the rows' own."""
    at = ", ".join(f"{k}={v}" for k, v in point.items())
    grown = ", ".join(f"{k}={own[k]}" for k, v in point.items() if k in own and v > own[k])
    whose, inputs = ("the example's", "inputs") if direct else ("the data's", "data")
    return ModelError(
        f"the model's output '{name}' is NaN or infinite at every value at {at}, where Kiln lengthened {whose} "
        "rows by padding their float inputs with zeros; with their own values repeated to that length it is "
        "finite: the zeros Kiln added, not the model, leave nothing there to compare (0/0 where a row is normalised)",
        hint=f"give {inputs} whose rows have that length, or list in signature.shapes sizes no longer than "
        f"{whose} ({grown})",
    )


# Sizes past the data's own the step probe tries besides its first draw (:func:`_first_probes`): a model that
# takes sizes in steps of one of these (strides and poolings: 2, 4, 8, ...; 3, 6, 12, ...) takes the data's size
# plus its step
_OWN_PLUS = (2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64)


def _steps_hint(
    model: nn.Module, like: Inputs, point: Mapping[str, int], feed: Feed, axes: Axes, listed: Mapping[str, list[int]]
) -> str:
    """The fix where PyTorch fails at ``point`` because a size there that ``signature.shapes`` lists (``listed``) is
    off the steps the model takes that axis in (a U-Net's odd height, which its pooling and upsampling cannot meet
    again): PyTorch runs on one row of ``feed`` at the sizes of the window :func:`size_steps` probes (two periods
    of :data:`MAX_PERIOD` from the smaller of that size and the data's), the other axes at the data's, and a period
    is said with the sizes nearest; empty where none explains it. Where a first sample shows no steps (the data's
    size alone runs, or every size from one on: :func:`_steps_may_show`), the window is not probed. Sizes Kiln
    made (half the data's) are left to the other hints."""
    own = _own_sizes(feed, axes)
    one = {k: v[:1] for k, v in feed.items()}
    said = []
    for label, size in point.items():
        if size not in listed.get(label, ()) or label not in own:
            continue
        low = min(size, own[label])
        high = low + 2 * MAX_PERIOD
        runs = _runs_at(model, one, like, axes, own, label)
        if not _steps_may_show(runs, [*_first_probes(low, high), *(own[label] + p for p in _OWN_PLUS)], own[label]):
            continue
        pattern = size_pattern(runs, low, high, label)
        if pattern is None or 2 * pattern[0] > high - low + 1 or takes_size(pattern, size):
            continue
        period = pattern[0]
        near = [s for s in range(max(1, size - period), size) if takes_size(pattern, s)][-1:]
        near += [s for s in range(size + 1, size + period + 1) if takes_size(pattern, s)][:1]
        said.append(
            f"{label}={size} is not a size the model takes: it takes {label}{steps_text(pattern)} "
            f"({', '.join(map(str, near))}, ...)"
        )
    return "; ".join(said) + ": list such sizes in signature.shapes" if said else ""


def _steps_may_show(runs: Callable[[int], bool], sizes: list[int], own: int) -> bool:
    """Whether the sizes PyTorch runs at among ``sizes`` and the data's (``own``) may follow steps: it runs at one
    besides ``own``, and in size order they turn from running to failing, or back, more than once. A model that
    takes the data's size alone, every size from a smallest on (a kernel wider than shorter inputs) or up to a
    largest (a position table) shows no steps, and the step probe's hundred-odd runs are saved."""
    order = sorted({*sizes, own})
    ran = [runs(s) for s in order]
    flips = sum(a != b for a, b in zip(ran, ran[1:]))
    return flips > 1 and any(r for s, r in zip(order, ran) if s != own)


def _runs_at(
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
    why."""

    @cache
    def runs(size: int) -> bool:
        point = {**base, label: size}
        inputs = from_feed(resize(feed, axes, point), like)
        try:
            ref = _torch_outputs(model, inputs)
        except Exception:  # the model cannot take that size
            return False
        why = _graph_misses(model, graph, like, feed, axes, point, inputs, ref) if graph is not None else ""
        if why and wrong is not None:
            wrong[size] = why
        return not why

    return runs


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
    apart), pass where the graph computes the model on them grown by their own values (:func:`_computes_untied`)."""
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
    tied = check["by_value"] or _integers_over(check, ref, atol, rtol)
    if tied and _computes_untied(model, path, session, like, feed, axes, point, atol, rtol):
        return ""
    return _over_tolerance(check, atol, rtol)


def export_at_sizes(
    model: nn.Module,
    example: Inputs,
    path: Path,
    opset: int,
    data: DatasetSplits,
    axes: Mapping[str, Mapping[int, str]] | None,
    shapes: Mapping[str, list[int]],
) -> tuple[onnx.ModelProto, str]:
    """:func:`export_with_fallback` with a dynamic batch and ``axes``; where both exporters fail and an axis varies,
    PyTorch runs first at the other sizes the later stages run (as :func:`check_validated_sizes` does after an
    export): a model that takes one size (a shape check of its own) fails there with its own error, which is then the
    one said, not the exporters' (an op traced at that one size the fallback exporter cannot write)."""
    try:
        return export_with_fallback(model, example, path, opset, True, axes)
    except ExportFailed:
        if axes:
            names = input_names(model, example)
            x, feed, seen = _parity_rows(data, names)
            for point, sized in _other_sizes(feed, seen, dict(axes), shapes):
                _torch_at(model, from_feed(sized, x), point, [feed, *seen], dict(axes), shapes)
        raise


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
    user's code a warning names (:func:`_pinned_at`)."""
    feed = feed_for_graph(x, names)
    smallest = {label: min(v) for label, v in sizes.items() if v}
    out = {}
    for label, values in sizes.items():
        wrong: dict[int, str] = {}
        runs = _runs_at(model, feed, x, axes, smallest, label, graph, wrong)
        pattern = size_pattern(runs, min(values), max(values), label)
        if pattern is not None:
            out[label] = pattern
        if pattern is not None and wrong:
            _warn_graph_steps(label, pattern, (min(values), max(values)), wrong, _pinned_at(model, example, axes))
        elif pattern is not None:
            log.info("signature axis %s: the model takes sizes%s only", label, steps_text(pattern))
    return out


def _warn_graph_steps(
    label: str, pattern: list[int], span: tuple[int, int], wrong: Mapping[int, str], line: str
) -> None:
    """The warning where the exported graph gives PyTorch's outputs on axis ``label`` at the sizes of ``pattern``
    only (within ``span``, the validated range), and not at the sizes of ``wrong`` (each with why), where PyTorch
    runs: the cause (the exporter fixed the side of a branch on the size its example took, at ``line`` of the user's
    code where :func:`_pinned_at` found it) and the fix, which lets one graph serve every size."""
    first = min(wrong)
    if not line:  # no line of the user's found (the branch may lie in a library's code, which they cannot edit)
        cause = (
            "the exporter fixed something that follows the size, a branch on it most likely (an `if L % stride "
            "!= 0:` pad in forward or in a library's module)"
        )
        fix = f"{BRANCH_FIX}; or give signature.shapes sizes on one side of it only"
    elif not _size_branch(line):
        cause, fix = f"the exporter fixed a size that signature.dynamic_axes makes vary in {line}", FIXED_SIZE_HINT
    else:
        cause, fix = f"the exporter kept the side its example took of a branch on the size in {line}", BRANCH_FIX
    log.warning(
        "signature axis %s: the exported graph gives PyTorch's outputs only at %s%s: at %s=%d, where PyTorch runs, "
        "%s; %s. The engines record these sizes and refuse the others; fix: %s",
        *(label, label, steps_text(pattern, span), label, first, wrong[first], cause, fix),
    )


def size_pattern(runs: Callable[[int], bool], low: int, high: int, label: str = "") -> list[int] | None:
    """``[period, *residues]`` of the sizes from ``low`` to ``high`` that ``runs``, or None where it runs at every size
    tried: the three after ``low`` and :data:`SIZE_PROBES` drawn from the two periods of :data:`MAX_PERIOD` above it
    (a fixed draw, so that a rerun finds the same; small sizes are cheap to run). Otherwise those two periods are
    probed size by size, and the shortest period at which every size runs as the one a period later is kept, with
    the remainders of the sizes that run; a range probed whole without one gets a period as long as the range: its
    sizes exactly."""
    top = min(high, low + 2 * MAX_PERIOD)
    if all(runs(size) for size in _first_probes(low, top)):
        return None
    ok = {size: runs(size) for size in range(low, top + 1)}
    width = top - low + 1
    period = next(
        (p for p in range(2, width // 2 + 1) if all(ok[s] == ok[s + p] for s in range(low, top + 1 - p))),
        width if top == high else None,
    )
    if period is None:
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
    return [period, *sorted({size % period for size, good in ok.items() if good})]


def _first_probes(low: int, top: int) -> list[int]:
    """The sizes :func:`size_pattern` tries first from ``low`` to ``top``: the three after ``low`` (sizes near the
    smallest: a period shows within two of them, cheaply) and :data:`SIZE_PROBES` drawn across the range (a fixed
    draw, so that a rerun finds the same)."""
    inside = range(low + 1, top + 1)
    return sorted({*inside[:3], *random.Random(0).sample(inside, min(SIZE_PROBES, len(inside)))})


# ------------------------------------------------------------------------ direct mode: `kiln export -o model.onnx`
def export_direct(
    cfg: ExportSettings, checkpoint: str | None, input_shapes: tuple[str, ...], output: Path
) -> dict[str, Any]:
    """Export ``cfg.model`` to ``output`` without a workdir. The example inputs are ``input_shapes``
    (``--input-shape``, random arrays of those shapes) or the first rows of the configured data; a model that takes
    neither is a ConfigError asking for each input's shape. The graph is checked as the pipeline checks it: at
    another batch, and at other sizes of ``signature.dynamic_axes`` (:func:`check_sizes_of`), so a graph that holds
    the example's length (a Python loop unrolled to it) is an error, not a file declaring that axis dynamic. Across
    the sizes checked, the graph is then held to PyTorch size by size (:func:`steps_over`): where it is right at some
    steps only (a branch on the size the exporter fixed), that is warned of, and the steps are written into the
    file's metadata (:func:`record_graph_steps`) and returned as ``axis_steps``."""
    ensure_writable(output.parent, "the -o file's folder")  # before minutes of work, not after
    specs = parse_input_shapes(input_shapes) if input_shapes else None
    model = build_model(cfg.model.name, cfg.model.params)
    checkpoint = checkpoint or cfg.model.checkpoint  # --checkpoint wins over the config's model.checkpoint
    if checkpoint:
        load_weights(model, read_state_dict(Path(checkpoint)), checkpoint)
    else:
        log.warning(
            "exporting '%s' with its initial weights: no --checkpoint and no model.checkpoint given", cfg.model.name
        )
    model.eval()
    x = _direct_example(cfg, model, specs)
    example = take(x, slice(0, 2))  # traced with two rows, like the pipeline's export
    refuse_random(model, example)
    refuse_nothing_finite(model, x if cfg.export.dynamic_batch else example, _example_source(specs), bool(specs))
    proto, dynamo = export_with_fallback(
        model, example, output, cfg.export.opset, cfg.export.dynamic_batch, cfg.signature.dynamic_axes
    )
    atol, rtol = cfg.export.parity_atol, cfg.export.parity_rtol
    session = ort_session(output)
    if cfg.export.dynamic_batch:  # at another batch too: a graph that holds the traced one gets those rows right
        check = batch_parity(model, output, example, x, atol, session, rtol)
    else:
        check = parity(model, output, example, session)
    random = (
        "random inputs can be far from what the model meets (masks, ids): give the config's data instead of "
        "--input-shape; "
        if specs
        else ""
    )
    # held to the tolerance the pipeline holds it to
    require_parity(check, atol, rtol, f"{output.name}, on {_example_source(specs)}", random)
    steps: dict[str, list[int]] = {}
    if cfg.signature.dynamic_axes:
        on = x if cfg.export.dynamic_batch else example  # a fixed batch takes the traced rows only
        names = [i.name for i in proto.graph.input]
        seen = [feed_for_graph(take(on, slice(0, 1)), names)]
        feed, axes = feed_for_graph(on, names), dict(cfg.signature.dynamic_axes)
        shapes = cfg.signature.shapes
        points = check_sizes_of(
            model, output, session, on, feed, seen, axes, shapes, atol, rtol, direct=True, dynamo=dynamo
        )
        one = take(on, slice(0, 1)) if cfg.export.dynamic_batch else on
        sizes = _checked_spans(feed, axes, points)
        steps = steps_over(model, one, example, names, axes, sizes, GraphAt(output, session, atol, rtol))
        record_graph_steps(output, steps)
    return {"path": str(output), "nodes": len(proto.graph.node), **check, "axis_steps": steps}


def _checked_spans(feed: Feed, axes: Axes, points: list[dict[str, int]]) -> dict[str, list[int]]:
    """Each named dynamic axis -> the sizes ``kiln export -o`` held the graph to PyTorch at: the example's own
    (the parity check's) and those of the size check (``points``, as :func:`_direct_point` moved them), whose
    smallest and largest bound the step probe (a size Kiln made that the model cannot take is no end of it)."""
    spans = {label: [size] for label, size in _own_sizes(feed, axes).items()}
    for point in points:
        for label, size in point.items():
            spans.setdefault(label, []).append(size)
    return spans


def record_graph_steps(path: Path, steps: Mapping[str, list[int]]) -> None:
    """Write the axis steps the export found (:func:`steps_over`) into the ONNX file's own metadata
    (:data:`GRAPH_STEPS_KEY`), where ``kiln build FILE`` reads them: an engine built from the file alone then
    refuses the sizes its graph gets wrong, as the pipeline's engines do. Nothing where no axis has steps."""
    if steps:
        set_metadata(path, GRAPH_STEPS_KEY, json.dumps(dict(steps), sort_keys=True))


# The fix where random --input-shape values are what the model cannot take
REAL_INPUTS_HINT = (
    "give it real inputs in place of --input-shape's random ones: a config whose data.name is a data function the "
    "model takes (kiln export CONFIG -o FILE)"
)


def refuse_nothing_finite(model: nn.Module, x: Inputs, source: str, random: bool = False) -> None:
    """A ModelError where an output of PyTorch's on ``kiln export -o``'s own rows ``x`` (``source``, in words) is NaN
    or infinite at every value (:func:`_nothing_finite`): the parity check would pass it with an error of 0, nothing
    compared, and no validation follows to fail it (the pipeline's does, at the data's size). On ``random`` inputs
    (``--input-shape``'s standard normal values) those values are the likely cause (the log of a negative number),
    and the fix asks for real ones. A model that fails on ``x`` is left to the parity check, which says why."""
    try:
        empty = _nothing_finite(_torch_outputs(model, x))
    except Exception as exc:  # noqa: BLE001 - the parity check runs it again and names the error
        log.debug("outputs on %s not checked for finite values: %s", source, first_line(exc))
        return
    if not empty:
        return
    said = (
        f"the model's output '{empty[0]}' is NaN or infinite at every value on {source}: nothing there can be compared"
    )
    if random:
        raise ModelError(
            f"{said}, and random normal values may be what it cannot take (the log or square root of a negative "
            "number)",
            hint=REAL_INPUTS_HINT,
        )
    raise ModelError(
        said,
        hint="find where it turns NaN or infinite (the log of 0, an exp that overflows float32, 0/0) and compute in "
        "a form that stays finite there, or check the data function's values",
    )


# An error this large a share of the value it is on is no float rounding: the graph computes another
# function (an op the exporter writes wrongly, as ``scatter_reduce(reduce="mean")``, for which ONNX has no reduction)
_WRONG_SHARE = 1e-3


def parity_error(check: dict[str, Any], atol: float, where: str, advice: str = "", rtol: float = 0.0) -> ModelError:
    """The export parity failure of a :func:`parity` result: the output furthest past its tolerance (``atol + rtol
    *`` the value its error is on), its error against that value, and a fix by that size. A small share is float
    rounding (fused or reordered arithmetic in ONNX Runtime), which a wider ``export.parity_rtol`` accepts; a large
    one is a graph that computes something else, which a wider tolerance would ship."""
    worst, err, top = _worst_output(check, atol, rtol)
    share = f", {err / top:.1%} of the value there, {top:.3g}" if top else ""
    said = f"output '{worst}'{share}" if worst else "all outputs"
    if not top or err / top > _WRONG_SHARE:
        hint = (
            f"{advice}the graph computes something else than the model there: an op the exporter writes wrongly "
            "(scatter_reduce with reduce='mean', which ONNX lacks), draws random numbers in eval mode or depends on "
            "the batch; return "
            "intermediate values as extra outputs to find the first that differs, and write it with other ops"
        )
    else:
        hint = (
            f"{advice}float rounding differs between the runtimes: raise export.parity_rtol (now {rtol:g}) above "
            f"the error's share of the value it is on, {err / top:.2g}, or export.parity_atol (now {atol:g})"
        )
    return ModelError(
        f"the exported graph differs from PyTorch ({where}): {_over_tolerance(check, atol, rtol)} ({said})", hint=hint
    )


def _worst_output(check: Mapping[str, Any], atol: float, rtol: float) -> tuple[str | None, float, float]:
    """The output of a :func:`parity` result furthest past its tolerance (``atol + rtol *`` the value its error is
    on), its error and that value; no name, the largest error and 0 where it names no outputs."""
    per, scale = check.get("per_output") or {}, check.get("scale") or {}
    if not per:
        return None, check["max_abs_err"], 0.0
    worst = max(per, key=lambda name: per[name] / max(atol + rtol * scale.get(name, 0.0), np.finfo(float).tiny))
    return worst, per[worst], scale.get(worst, 0.0)


def _over_tolerance(check: Mapping[str, Any], atol: float, rtol: float) -> str:
    """``max abs error E > export.parity_atol A + export.parity_rtol R x S``: the worst output's error against its
    tolerance (:func:`_worst_output`), in words."""
    _, err, top = _worst_output(check, atol, rtol)
    return f"max abs error {err:.3g} > export.parity_atol {atol:g} + export.parity_rtol {rtol:g} x {top:.3g}"


def _example_source(specs: list[TensorSpec] | None) -> str:
    """Where direct export's example inputs came from, for its parity error."""
    return "random inputs of the --input-shape sizes" if specs else "the first rows of the configured data"


def _direct_example(cfg: ExportSettings, model: nn.Module, specs: list[TensorSpec] | None) -> Inputs:
    """``PARITY_ROWS`` rows of example inputs the model is known to take: of ``specs`` (``--input-shape``) or the
    data's (fewer where the data has fewer)."""
    if specs:
        example = example_inputs(specs, PARITY_ROWS)
        what = "the inputs --input-shape gives (" + _describe(specs) + ")"
    elif cfg.data.name is None and cfg.model.name not in DEFAULT_DATASET and not cfg.model.onnx:
        raise ConfigError(
            f"cannot tell which inputs model '{cfg.model.name}' takes: no --input-shape and no data configured",
            hint=input_shape_hint(model),
        )
    else:
        data = dataset_for(cfg.model, cfg.data, cfg.signature, cfg.seed)
        example = take(data.val_x, slice(0, PARITY_ROWS))
        what = f"the inputs of dataset '{cfg.data.name or data.name}'"
    try:
        with torch.no_grad():
            call(model, example)
    except Exception as exc:  # the model rejects them: say so, not "an op ONNX cannot express" or a traceback
        reason = first_line(exc)
        hint = input_shape_hint(model, random=bool(specs))
        raise ConfigError(f"model '{cfg.model.name}' rejects {what}: {reason}", hint=hint) from None
    return example


def input_shape_hint(model: nn.Module, random: bool = False) -> str:
    """The fix for a model whose inputs Kiln cannot tell: one ``--input-shape`` per input of its forward. With
    ``random``, for a model that rejected ``--input-shape``'s inputs: their random values (a length of 0, an id
    it has no row for) may be what it rejects, not their shapes, and real inputs come from a data function."""
    names = forward_inputs(model) or ["NAME"]
    flags = " ".join(f"--input-shape {n}=DIMS" for n in names)
    shapes = f"{flags} (e.g. image=3,224,224, ids=128:int64, t=():int64 for one value per sample)"
    if random:
        return (
            "--input-shape gives random values (floats standard normal, integers 0 or 1), which the model may reject "
            "where the shapes are right (a length of 0): give it real inputs, a config whose data.name is a data "
            f"function the model takes (kiln export CONFIG -o FILE); else check each input's shape, one sample "
            f"without the batch axis: {shapes}"
        )
    return (
        f"give each input's shape, one sample without the batch axis: {shapes}, or a config whose data.name is a "
        "data function the model takes"
    )


INPUT_SHAPE_FORM = "[NAME=]DIMS[:DTYPE]"
# What DIMS may be: sizes, or nothing for a sample without axes (one value per sample, the input is [batch])
INPUT_SHAPE_HINT = (
    f"give {INPUT_SHAPE_FORM}, DIMS one sample's shape without the batch axis: positive integers (3,224,224 or "
    "3x224x224), or () for one value per sample, an input of shape [batch] (a timestep: t=():int64, or t=:int64); "
    "e.g. image=3x224x224 or ids=128:int64"
)


def parse_input_shapes(texts: tuple[str, ...]) -> list[TensorSpec]:
    """``--input-shape`` values, ``[NAME=]DIMS[:DTYPE]``: one sample's shape (positive integers separated by ``,``
    or ``x``, in parentheses or not, no batch axis; ``()`` or nothing for a sample without axes, whose input is
    ``[batch]``: a timestep per sample) and dtype (float32 by default) per input, as specs with a leading ``batch``
    axis. An unnamed shape is the model's only input (``input``), so it stands alone."""
    specs = [_parse_input_shape(t) for t in texts]
    names = [s.name for s in specs]
    if SINGLE_INPUT in names and len(specs) > 1 and not all("=" in t for t in texts):
        raise ConfigError(
            f"--input-shape given {len(specs)} times, not every one named: {list(texts)}",
            hint="name each input of a model with several: --input-shape x=8 --input-shape meta=3",
        )
    if len(set(names)) < len(names):
        raise ConfigError(f"--input-shape names an input twice: {names}", hint="give one --input-shape per input")
    return specs


def _parse_input_shape(text: str) -> TensorSpec:
    name, sep, rest = text.rpartition("=")
    dims, _, dtype = rest.partition(":")
    shape = _dims(dims)
    try:
        np.dtype(dtype or "float32")
    except (TypeError, ValueError):
        shape = None
    if shape is None or not text.strip() or (sep and not name.isidentifier()):
        raise ConfigError(f"--input-shape '{text}' is not {INPUT_SHAPE_FORM}", hint=INPUT_SHAPE_HINT)
    return TensorSpec(name=name if sep else SINGLE_INPUT, shape=["batch", *shape], dtype=dtype or "float32")


def _dims(text: str) -> list[int] | None:
    """One sample's sizes: ``3,224,224``, ``3x224x224`` or ``(3, 224, 224)``; ``()`` or nothing is a sample without
    axes. None for anything else (a size below 1, a word)."""
    inner = text.strip()
    if inner.startswith("(") and inner.endswith(")"):
        inner = inner[1:-1].strip()
    if not inner:
        return []
    try:
        shape = [int(s) for s in re.split(r"[,x]", inner)]
    except ValueError:
        return None
    return shape if all(d >= 1 for d in shape) else None


def example_inputs(specs: list[TensorSpec], batch: int = 2) -> Inputs:
    """Random inputs of ``specs`` (floats standard normal, integers 0 or 1, which any embedding takes; an input
    named like an attention mask a valid one, :func:`valid_mask`): one tensor for an unnamed shape, else a dict by
    name (the model is called with keywords)."""
    arrays = random_inputs(specs, batch, hint="give every axis a size in --input-shape")
    arrays = {k: valid_mask(v) if is_mask_name(k) else v for k, v in arrays.items()}
    x = {k: torch.from_numpy(v) for k, v in arrays.items()}
    return x[SINGLE_INPUT] if [s.name for s in specs] == [SINGLE_INPUT] else x


def valid_mask(like: np.ndarray) -> np.ndarray:
    """An attention mask of ``like``'s shape and dtype as tokenizers pad: each row ones then zeros along its last
    axis, the first row whole and each next one a token shorter, never below one token. Random 0/1 would mask a
    row's first token, whose query under a causal mask then attends to no key: PyTorch and ONNX Runtime answer
    such a row differently, and the parity check would fail a good graph."""
    if like.ndim < 2:
        return np.ones_like(like)
    length = like.shape[-1]
    kept = np.maximum(1, length - np.arange(like.shape[0]) % length)
    shape = (like.shape[0],) + (1,) * (like.ndim - 1)
    return np.broadcast_to(np.arange(length) < kept.reshape(shape), like.shape).astype(like.dtype)


def _describe(specs: list[TensorSpec]) -> str:
    return ", ".join(f"'{s.name}' {s.dtype}[{', '.join(map(str, s.shape))}]" for s in specs)


def take_onnx(src: Path, path: Path) -> ExportSummary:
    """``model.onnx``: the user's file in place of an export, checked and shape-inferred like one. A file whose batch
    axis is a number (published files often fix it at 1) gets a symbolic one, once the graph is shown to compute the
    same rows at twice that batch (:func:`free_checked`): the batch sizes are the run's to choose."""
    proto = load_onnx(src)
    check_tensor_io(proto, f"model.onnx {src.name}")
    fixed = fixed_batch(proto)
    proto = free_checked(proto, src, *fixed) if fixed else infer_shapes(proto, strict=False)
    save_onnx(proto, path)
    check_onnx(path, f"model.onnx {src.name}")
    inputs, outputs = io_specs(proto)
    log.info("took %s (%d nodes) instead of exporting", src, len(proto.graph.node))
    return ExportSummary(
        nodes=len(proto.graph.node),
        source=str(src),
        inputs=[i.name for i in inputs],
        outputs=[o.name for o in outputs],
        opset=max((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), default=0),
        freed_batch=fixed[0] if fixed else None,
    )


def free_checked(proto: onnx.ModelProto, src: Path, batch: int, example: str) -> onnx.ModelProto:
    """``proto`` with a symbolic batch axis (:func:`kiln.core.onnx_io.free_batch`), checked: two random batches of
    ``batch`` rows run through the file as it is, and as one batch through the freed graph, must give the same rows.
    Where they do not (a Reshape to a fixed ``[1, -1]``), a ModelError says to export it with a dynamic batch."""
    inputs, _ = io_specs(proto)
    original = ort_session(src)
    parts = [
        random_inputs(inputs, batch, dynamic=8, seed=seed, hint="export it with a dynamic batch axis")
        for seed in (1, 2)
    ]
    want = [ort_run(original, part) for part in parts]
    freed = free_batch(proto, batch)
    hint = (
        "export it again with a dynamic batch axis (torch.onnx.export(..., dynamic_axes={'<input>': {0: 'batch'}})), "
        "or let Kiln export it from PyTorch (model.name)"
    )
    try:
        got = ort_run(ort_session(freed), {k: np.concatenate([p[k] for p in parts]) for k in parts[0]})
    except Exception as exc:  # ONNX Runtime's own error: a node that takes the fixed size only
        raise ModelError(
            f"model.onnx {src.name} fixes the batch at {batch} (input {example}) and does not run at batch "
            f"{2 * batch}: {first_line(exc)}",
            hint=hint,
        ) from None
    for (name, out), first, second in zip(enumerate(got), *want):
        ref = np.concatenate([first, second]) if first.ndim and len(first) == batch else first
        ok, _, why = within_tolerance(ref, out, atol=1e-5, rtol=1e-4)
        if not ok:
            raise ModelError(
                f"model.onnx {src.name} fixes the batch at {batch} (input {example}) and its graph depends on it: "
                f"at batch {2 * batch} output {proto.graph.output[name].name} {why}",
                hint=hint,
            )
    log.info(
        "model.onnx %s fixed the batch at %d: its batch axis is now symbolic (checked at %d)",
        src.name,
        batch,
        2 * batch,
    )
    return freed


def refuse_other_output_names(model: nn.Module, x: Inputs, outputs: list[str], shown: str, name: str) -> None:
    """The PyTorch model ``name`` (validation's reference) against the outputs of the taken ``model.onnx`` (``shown``):
    validation compares outputs by name, so each of PyTorch's must be one of the file's. Told here, where the file
    is taken, with both lists: no export Kiln runs can rename the user's file. A model that fails on the data's
    first rows ``x`` is left to the stages that run it, which say why."""
    try:
        named = list(_torch_outputs(model, x))
    except KilnError:
        raise
    except Exception as exc:  # the model's own error on the data: validation names it with its fix
        log.debug("outputs of model '%s' not compared with %s: %s", name, shown, first_line(exc))
        return
    missing = [n for n in named if n not in outputs]
    if not missing:
        return
    raise ModelError(
        f"model '{name}' returns outputs {named}, model.onnx {shown} has {outputs}: validation compares them by name "
        f"and finds no {missing} in the file",
        hint=_rename_hint(named, outputs, shown),
    )


def _rename_hint(named: list[str], outputs: list[str], shown: str) -> str:
    """The fix for outputs named apart: name the file's outputs as PyTorch's, or return a dict of the file's."""
    if len(named) == len(outputs) == 1:
        renamed = f"rename the output '{outputs[0]}' of {shown} to '{named[0]}'"
    else:
        renamed = f"name the outputs of {shown} {named}"
    keys = ", ".join(f"'{o}': ..." for o in outputs)
    return (
        f"{renamed} (torch.onnx.export(..., output_names={named})), or have forward return a dict with the file's "
        f"names, {{{keys}}}"
    )


def refuse_outside_index(data: DatasetSplits, path: Path, shown: str, name: str) -> None:
    """Each split of ``data`` (``name``: the data function) against the tables the taken graph at ``path`` (the
    user's ``shown``) indexes (:func:`kiln.core.onnx_io.outside_index`), before any stage runs it on them: ONNX
    Runtime would stop at a token id past an embedding's rows with a traceback naming a node, not the input. Data
    that do not fit the graph's inputs are left to the stages that run it, which say why."""
    graph = load_onnx(path, load_external_data=False)
    names = [i.name for i in io_specs(graph)[0]]
    for split, x in (("training", data.train_x), ("validation", data.val_x)):
        try:
            feed = feed_for_graph(x, names) if rows(x) else {}
        except KilnError:
            return
        why = outside_index(graph, feed, shown)
        if why is not None:
            raise DataContractError(f"the {split} data of '{name}': {why}", hint=INDEX_HINT)


def _probe_taken(ctx: StageContext[ExportSettings]) -> dict[str, dict[int, str]]:
    """:func:`name_output_axes` on a taken ``model.onnx``, with the data's first held-out rows, over the axes the file
    declares dynamic under the file's own names (a two-tower model's ``texts`` and ``images`` are probed apart, and
    its outputs keep them); nothing where the data does not fit the file (the stages that run it say why)."""
    path = ctx.out / "model.onnx"
    inputs, _ = io_specs(load_onnx(path, load_external_data=False))
    names = [i.name for i in inputs]
    try:
        feed = feed_for_graph(take(ctx.dataset().val_x, slice(0, 2)), names)
    except KilnError as exc:
        log.info("output axes of %s not probed: %s", path.name, exc.message)
        return {}
    # axes named apart by their exporter that the graph takes at one size: one axis (both ties run)
    if tie_batch_axes(path, feed) | tie_other_axes(path, feed):
        inputs, _ = io_specs(load_onnx(path, load_external_data=False))
    axes = {s.name: {0: str(s.shape[0])} for s in inputs if s.shape and isinstance(s.shape[0], str)}
    for name, dims in graph_axes(inputs).items():
        axes.setdefault(name, {}).update(dims)
    return name_output_axes(path, feed, axes)


def run(ctx: StageContext[ExportSettings]) -> ExportSummary:
    cfg = ctx.config.export
    if ctx.config.model.onnx:
        if on_random_inputs(ctx.config.model, ctx.config.data):  # said now, not after optimize
            specs, _ = io_specs(load_onnx(ctx.config.model.onnx, load_external_data=False))
            random_axis_size(Path(ctx.config.model.onnx), specs, ctx.config.signature)
        summary = take_onnx(Path(ctx.config.model.onnx), ctx.out / "model.onnx")
        if not on_random_inputs(ctx.config.model, ctx.config.data):
            src = Path(ctx.config.model.onnx)
            refuse_outside_index(ctx.dataset(), ctx.out / "model.onnx", src.name, ctx.config.data.name or "the data")
        if torch_model_named(ctx.config.model) and "train" in ctx.inputs:
            model = load_trained(ctx.inputs["train"], ctx.config.model)
            example = take(ctx.dataset().val_x, slice(0, 2))
            refuse_other_output_names(
                model, example, summary.outputs, Path(ctx.config.model.onnx).name, ctx.config.model.name
            )
        return summary.model_copy(update={"output_axes": _probe_taken(ctx)})
    if not cfg.dynamic_batch:
        # A static graph is fixed at the export example's batch; parity, build and validate all need others.
        raise ConfigError(
            "export.dynamic_batch: false cannot run through the pipeline, which checks and times "
            "the engines at every size in signature.batch_sizes",
            hint="keep export.dynamic_batch: true; for a fixed-batch file use `kiln export "
            "--checkpoint W.safetensors -o model.onnx --set export.dynamic_batch=false`",
        )
    model = load_trained(ctx.inputs["train"], ctx.config.model)
    data = ctx.dataset()
    path = ctx.out / "model.onnx"
    axes = ctx.config.signature.dynamic_axes
    example, x = take(data.val_x, slice(0, 2)), take(data.val_x, slice(0, PARITY_ROWS))
    refuse_random(model, example)
    warn_wide_inputs(model, example)
    proto, dynamo = export_at_sizes(model, example, path, cfg.opset, data, axes, ctx.config.signature.shapes)
    session = ort_session(path)  # for the parity check and the output-axis probe
    check = batch_parity(model, path, example, x, cfg.parity_atol, session, cfg.parity_rtol)
    require_parity(check, cfg.parity_atol, cfg.parity_rtol, f"{path.name}, on the data's first {check['samples']} rows")
    log.info(
        "exported %d nodes, opset %d, parity max abs err %.2e",
        len(proto.graph.node),
        proto.opset_import[0].version,
        check["max_abs_err"],
    )
    names = [i.name for i in proto.graph.input]
    shapes, atol, rtol = ctx.config.signature.shapes, cfg.parity_atol, cfg.parity_rtol
    check_validated_sizes(model, path, session, data, names, axes or {}, shapes, atol, rtol, dynamo)
    steps = size_steps(model, data, names, axes or {}, shapes, GraphAt(path, session, atol, rtol))
    if steps:
        (ctx.out / AXIS_STEPS).write_text(json.dumps(steps, indent=2, sort_keys=True) + "\n")
    feed = feed_for_graph(take(data.val_x, slice(0, 2)), names)
    followed = name_output_axes(path, feed, _axes(names, cfg.dynamic_batch, axes or {}), session)
    record_graph_steps(path, steps)  # the file carries them too, for `kiln build` of it outside the run
    sizes = dynamic_sizes(data, names, axes)
    if sizes:
        (ctx.out / DYNAMIC_SIZES).write_text(json.dumps(sizes, indent=2, sort_keys=True) + "\n")
    ranges = integer_ranges(data, names, fixed_columns(io_specs(proto)[0], index_ranges(proto)))  # packed: per column
    if ranges:
        (ctx.out / INT_RANGES).write_text(json.dumps(ranges, indent=2, sort_keys=True) + "\n")
    return ExportSummary(
        nodes=len(proto.graph.node),
        opset=max(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")),
        parity=check,
        dynamic_sizes=sizes,
        int_ranges=ranges,
        axis_steps=steps,
        output_axes=followed,
    )


def dynamic_sizes(
    data: Any, names: list[str], axes: Mapping[str, Mapping[int, str]]
) -> dict[str, dict[int, list[int]]]:
    """Input name -> axis -> [smallest, largest] size in the data, for each axis of ``signature.dynamic_axes``:
    sizes the model is known to take, for the optimizer's safety net (its random inputs)."""
    feeds = [feed_for_graph(take(x, slice(0, 1)), names) for x in (data.train_x, data.val_x) if rows(x)]
    if not feeds:
        return {}
    seen = {name: {int(a): [f[name].shape[int(a)] for f in feeds] for a in dims} for name, dims in axes.items()}
    return {name: {a: [min(v), max(v)] for a, v in dims.items()} for name, dims in seen.items()}
