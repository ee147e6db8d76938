"""The export itself: ``torch.onnx.export`` of a PyTorch model (the dynamo exporter, the TorchScript one as a
fallback), its inputs and outputs named, its dynamic axes kept under the config's names, and the exporters' failures
said as the user's code's (the op and line the exporter stopped at, the line a trace fixed a branch at) or as the
library setting they come from (QAT's fake-quantize modules, transformers' experts implementation). The checks
that hold the graph it writes to PyTorch live apart (:mod:`.parity`, :mod:`.sizes`): this module knows torch's
exporters, they know the graph."""

from __future__ import annotations

import linecache
import logging
import os
import re
import sys
import time
import traceback
import warnings
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple

import onnx
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from kiln.core import interrupt
from kiln.core.data import Inputs, check_axes_name_inputs, input_names, rows, tensors
from kiln.core.errors import ModelError
from kiln.core.onnx_io import check_onnx, infer_shapes, load_onnx, rename_values, save_onnx, value_names
from kiln.core.outputs import FlatModel, named_outputs
from kiln.core.text import first_line, root_cause
from kiln.core.user_errors import is_user_file, user_frame, where
from kiln.stages.export.bags import bags_as_lookups
from kiln.stages.export.graph_inputs import refuse_label_outputs, warn_unused_inputs
from kiln.stages.export.pinned_sizes import BATCH_FIXED_HINT, BRANCH_FIX, FIXED_SIZE_HINT, pinned_at, size_branch
from kiln.stages.export.quiet import SHAPES_LOG, quiet_torch
from kiln.stages.export.torch_dims import restore_axis_names, torch_dims

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
    axes = input_axes(names, dynamic_batch, dynamic_axes or {})
    # The dynamo exporter writes opset 18 at least, whatever is asked; older opsets need the TorchScript one.
    fixed: list[str] = []
    validation = ""  # where torch.distributions' argument validation made the dynamo exporter fail
    refused = ""  # why the dynamo exporter failed, where the TorchScript one then exported the graph
    took = 0.0  # the dynamo exporter's seconds to its failure
    raised: Raised | None = None  # the call torch's error says raised the dynamo exporter's failure
    cause: Cause | None = None  # a library's setting the failure comes from (QAT's fake-quantize, MoE experts)
    branches: list[str] = []  # where the TorchScript exporter's trace fixed a branch of the user's code
    for dynamo in (True, False) if opset >= 18 else (False,):
        pinned: list[str] = []  # where torch.export fixed a size to the example's
        if dynamo:  # it may trace for minutes before it fails: said, so the time is seen to go there
            log.info("export: dynamo exporter running (torch.onnx.export)")
        started = time.perf_counter()
        try:
            with bags_as_lookups(model):  # padded bags as a lookup and a sum, not a Loop over the bags
                placed, branches = _export(
                    FlatModel(model, example),
                    tuple(tensors(example)),
                    ins,
                    placeholders,
                    path,
                    opset,
                    {p: axes[n] for p, n in zip(ins, names)},
                    dynamo,
                )
            fixed, pinned = ([], placed) if dynamo else (placed, [])
            lost = _lost_axes(path, dict(zip(ins, names)), axes)
            if not lost:
                break
            # torch.export may specialise an axis it was told is dynamic (an nn.GRU's length), without an error
            raise ValueError(_FIXED_AXES + _fixed_axes_text(lost, dynamic_axes or {}))
        except Exception as exc:  # the exporter raises many types; keep the message for the user
            interrupt.check()  # a Ctrl-C that landed inside the exporter's imports came out as another error
            errors.append(f"{'dynamo' if dynamo else 'torchscript'} exporter: {error_reason(exc)}")
            cause = cause or known_cause(model, exc)
            if dynamo:
                validation, refused = _in_distributions(exc), _with_cause(error_reason(exc), _causal_mask_cause(exc))
                refused += _places(pinned) or _batch_split(refused)
                raised = _raised_at(exc)
                took = time.perf_counter() - started
                log.warning("dynamo exporter failed: %s (%.1f s); trying the TorchScript exporter", refused, took)
    else:
        raise _export_failed(model, example, errors, opset, axes, raised, cause, fixed_places(refused))
    if fixed:  # before the hint to skip the dynamo exporter, which a refused graph does not need
        branches = _from_values(model, example, branches) if branches else []
        refuse_traced_branch(fixed, errors, validation, raised, cause, branches)
    if refused:
        _say_fallback_took(took, time.perf_counter() - started)
    proto = load_onnx(path)
    _drop_debug_metadata(proto.graph)
    restore_axis_names(proto.graph, {d for a in axes.values() for d in a.values()})
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


def _say_fallback_took(dynamo_s: float, torchscript_s: float) -> None:
    """Log that the TorchScript exporter exported the graph after the dynamo exporter's failed attempt, and how to
    skip that attempt (below opset 18 only the TorchScript exporter runs), which may cost a minute on every export
    of the model (an LSTM with a dynamic length)."""
    log.warning(
        "the TorchScript exporter exported the graph (%.1f s) after the dynamo exporter's failed attempt (%.1f s): "
        "export.opset: 17 exports with the TorchScript exporter directly, skipping those %.1f s",
        *(torchscript_s, dynamo_s, dynamo_s),
    )


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


def input_axes(
    names: list[str], dynamic_batch: bool, extra: Mapping[str, Mapping[int, str]]
) -> dict[str, dict[int, str]]:
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


# What the dynamo exporter writes on each node that nothing reads: the Python stack the node was traced at and its
# torch.fx node, most of a small model's file (the module scopes, which Kiln reads, stay)
_DEBUG_METADATA = frozenset({"pkg.torch.onnx.stack_trace", "pkg.torch.onnx.fx_node"})


def _drop_debug_metadata(graph: onnx.GraphProto) -> None:
    """Drop the exporter's debug metadata (:data:`_DEBUG_METADATA`) from the nodes of ``graph`` and its subgraphs,
    so the exported file, and each later load of it, is not mostly stack traces."""
    for node in graph.node:
        kept = [p for p in node.metadata_props if p.key not in _DEBUG_METADATA]
        if len(kept) < len(node.metadata_props):
            del node.metadata_props[:]
            node.metadata_props.extend(kept)
        for attr in node.attribute:
            for sub in [attr.g] if attr.HasField("g") else attr.graphs:
                _drop_debug_metadata(sub)


def _lost_axes(path: Path, names: dict[str, str], axes: dict[str, dict[int, str]]) -> list[tuple[str, int, str]]:
    """The dynamic input axes (``axes``: input -> {axis: name}) the file at ``path`` declares with a fixed size, as
    (the model's input name, axis, axis name); ``names``: the file's input name -> the model's."""
    shell = onnx.load(str(path), load_external_data=False)
    lost = []
    for inp in shell.graph.input:
        dims = inp.type.tensor_type.shape.dim
        name = names.get(inp.name, inp.name)
        for axis, label in axes.get(name, {}).items():
            if axis < len(dims) and dims[axis].HasField("dim_value"):
                lost.append((name, axis, label))
    return lost


def _fixed_axes_text(lost: list[tuple[str, int, str]], dynamic_axes: Mapping[str, Mapping[int, str]]) -> str:
    """The axes an exporter fixed (:func:`_lost_axes`), each group with the setting that makes it dynamic: the
    ones ``signature.dynamic_axes`` names (``dynamic_axes``), and the batch, axis 0, which ``export.dynamic_batch``
    makes dynamic where that mapping does not name it: ``input 'x' axis 0 (batch), which export.dynamic_batch makes
    dynamic, and input 'x' axis 2 (time), which signature.dynamic_axes makes dynamic``."""
    groups: dict[str, list[str]] = {}
    for name, axis, label in lost:
        named = {int(a) for a in dynamic_axes.get(name, {})}
        setting = "signature.dynamic_axes" if axis in named or axis != 0 else "export.dynamic_batch"
        groups.setdefault(setting, []).append(f"input '{name}' axis {axis} ({label})")
    return ", and ".join(f"{', '.join(axes)}, which {setting} makes dynamic" for setting, axes in groups.items())


def error_reason(exc: BaseException) -> str:
    """The most specific line of an exporter error (the dynamo exporter wraps the real cause), the op its ONNX
    translation was converting (:func:`_failed_node`), and where in the user's own code it arose, where those can
    be told."""
    node = _failed_node(exc)
    op = f", converting {node.target}" if node is not None else ""
    return _cut(first_line(root_cause(exc), limit=sys.maxsize)) + op + _user_location(exc)


# Where a long error line may be cut, best first: after a closed item of a list, between items, between words
_CUT_AT = ("), ", "], ", ", ", "; ", " ")


def _cut(line: str, limit: int = 300) -> str:
    """``line`` cut to about ``limit`` characters at a separator (:data:`_CUT_AT`), not inside a word or a size
    (``FakeTensor(..., size=(u0, 32))`` lists run for pages), with `` ...`` saying more was said."""
    if len(line) <= limit:
        return line
    head = line[:limit]
    end = next((i + len(sep.rstrip()) for sep in _CUT_AT if (i := head.rfind(sep)) > limit // 2), limit)
    return head[:end].rstrip(",;") + " ..."


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
) -> tuple[list[str], list[str]]:
    """Export ``model`` to ``path``; returns where the TorchScript exporter's trace turned a tensor into a Python
    value (``file:line``, the user's code or a library's: :func:`refuse_traced_branch`) and where of those the user's
    code decided a branch with it (:func:`traced_branch`), or, for dynamo, where torch.export fixed a size to the
    example's (:func:`_pinned_places`) and no branches: the exporter keeps such an axis silently where ``axes`` make
    it dynamic, so only its log tells the line."""
    kw: dict[str, Any] = dict(input_names=names, output_names=outputs, opset_version=opset, dynamo=dynamo)
    if dynamo:
        # Graph rewriting is the optimize stage's job (verified, reported, reversible per pass), so export raw.
        kw["optimize"] = False
        # one Dim per name: a shared name means equal sizes (input_ids/attention_mask)
        dims = torch_dims({d for a in axes.values() for d in a.values()})
        if any(axes.values()):
            # FlatModel takes *xs: the exporter sees them as one (tuple) argument
            kw["dynamic_shapes"] = (tuple({a: dims[d] for a, d in axes[n].items()} or None for n in names),)
    elif any(axes.values()):
        kw["dynamic_axes"] = {n: a for n, a in axes.items() if a} | {
            o: {0: "batch"} for o in outputs if any(0 in a for a in axes.values())
        }
    # autograd stays on (under no_grad an nn.TransformerEncoderLayer in eval mode takes its fused fast path,
    # aten::_transformer_encoder_layer_fwd, which neither exporter writes), except for complex weights, whose
    # autograd refuses ops (slice_scatter) before the exporter reaches what it cannot write: complex values
    grad = torch.no_grad() if any(t.is_complex() for t in model.parameters()) else nullcontext()
    guards: list[str] = []
    # torch's shape log at INFO costs a stack summary per guard: heard only where an axis besides the batch varies,
    # the axes a Python loop or a size read as an int fixes (a fixed batch is probed on its own path: pinned_at)
    varies = any(axis for dims in axes.values() for axis in dims)
    heard = _guards_heard(guards) if dynamo and varies else nullcontext()
    with quiet_torch(), heard, warnings.catch_warnings(record=True) as said, grad:
        warnings.simplefilter("ignore")
        warnings.simplefilter("always", torch.jit.TracerWarning)
        torch.onnx.export(model, args, str(path), **kw)
    if dynamo:
        return _pinned_places(guards), []
    places = list(dict.fromkeys(place for w in said if (place := traced_value(w))))
    return places, list(dict.fromkeys(place for w in said if (place := traced_branch(w))))


@contextmanager
def _guards_heard(heard: list[str]) -> Iterator[None]:
    """The guards torch's symbolic-shapes log says torch.export adds while it traces, appended to ``heard``; each
    names the line it was added at. Only this handler hears them (torch's own would print to the terminal)."""
    shapes = logging.getLogger(SHAPES_LOG)
    saved = shapes.level, shapes.propagate, shapes.handlers
    catch = logging.Handler()

    def hear(record: logging.LogRecord) -> None:
        if _GUARD_ADDED in (message := record.getMessage()):
            heard.append(message)

    catch.emit = hear  # type: ignore[method-assign]
    shapes.setLevel(logging.INFO)
    shapes.propagate, shapes.handlers = False, [catch]
    try:
        yield
    finally:
        shapes.setLevel(saved[0])
        shapes.propagate, shapes.handlers = saved[1:]


_GUARD_ADDED = "[guard added]"
# A guard that fixes a size to a number (``Eq(s53, 16)``), and the line torch's log says it was added at
_CONSTANT_GUARD = re.compile(r"\bEq\([^,]+, -?\d+\) \[guard added\] \((.+?):(\d+) in [\w<>]+\)")


def _pinned_places(guards: list[str]) -> list[str]:
    """``file:line`` (the file by its name) of each guard in ``guards`` that fixes a size to the example's, outside
    torch's own files: the user's code or a library's (a Python loop over the size, a size read as an int)."""
    torch_dir = Path(torch.__file__).parent
    found = (g.groups() for text in guards if (g := _CONSTANT_GUARD.search(text)))
    # torch's log names a file relative to torch's folder, else to their common parent
    return list(dict.fromkeys(f"{Path(f).name}:{n}" for f, n in found if not (torch_dir / f).is_file()))


def _places(places: list[str]) -> str:
    """``, at a.py:3, b.py:9``: where torch.export fixed a size (:func:`_pinned_places`), the first three; empty where
    none is known."""
    more = f" and {len(places) - 3} more" if len(places) > 3 else ""
    return f", at {', '.join(places[:3])}{more}" if places else ""


def _batch_split(refused: str) -> str:
    """What the dynamo exporter's failure (``refused``) leaves unsaid where it fixed the batch (axis 0) and torch's
    log named no line (:func:`_places` is empty): an op that splits the batch into a fixed number of pieces
    (classifier-free guidance's ``eps.chunk(2)`` after ``torch.cat([x, x])``) guards the batch to the example's,
    which slicing by a size taken from the shape does not. Empty for another failure."""
    if not refused.startswith(_FIXED_AXES) or " axis 0 (" not in refused:
        return ""
    return (
        "; torch named no line: if the model splits the batch into a fixed number of pieces (chunk, split or unbind "
        "over axis 0, as eps.chunk(2) after torch.cat([x, x])), that fixes it: slice instead (eps[:B], eps[B:] with "
        "B = x.shape[0])"
    )


# The TorchScript tracer's warning where Python code reads a tensor's value (``if x.sum() > 0``, ``.item()``,
# ``int(t)``): the trace records the value the example gave as a constant
_TO_PYTHON = "Converting a tensor to a Python"
# The same warning where the value is a truth value (``if x.sum() > 0:``): Python decided a branch with it
_TO_BOOL = "Converting a tensor to a Python boolean"
# How the dynamo exporter says a Python branch or value depends on the inputs' values
_DATA_DEPENDENT = ("data-dependent", "data dependent", "DataDependent")


_OWN_EXPORT = "export the model yourself and give Kiln the file (model: {onnx: model.onnx})"
_BRANCH_CHANGE = "write the branch with tensor ops (torch.where) or torch.cond, which the dynamo exporter exports"
_SIZE_CHANGE = (
    "compute at sizes the inputs' shapes give, not sizes read from their values: dense or masked (every row through "
    "each path, the rows it does not take zeroed by a mask or torch.where) instead of rows picked or split by counts "
    "read with .tolist()/.item()"
)
DATA_BRANCH_FIX = f"{_BRANCH_CHANGE}, or {_OWN_EXPORT}"
SIZE_FROM_VALUES_FIX = f"{_SIZE_CHANGE}; or {_OWN_EXPORT}"
# How the dynamo exporter says Python code read a tensor's value as a number (a size, a split's counts)
_SIZE_FROM_VALUES = "extract specialized integer"
# How the dynamo exporter says an op's output size comes from the inputs' values (nonzero, a boolean mask), where
# it cannot carry that size out of the code that made it (a torch.cond branch, a graph output)
_UNBACKED_SIZES = "Pending unbacked symbols"
DENSE_FIX = (
    "compute the dense form instead: every row through each path, weighted by a mask or gate (every expert on every "
    "token, each output times its routing weight, zero where the token is not routed there) rather than rows picked "
    f"with nonzero, a boolean mask or torch.unique; or {_OWN_EXPORT}"
)


def _data_dependent(dynamo: str) -> bool:
    """Whether the dynamo exporter's failure (``dynamo``) is a guard on the inputs' values (``Could not guard on
    data-dependent expression u1 < 64``): Python code that decides a branch or a size from them, which torch.export
    cannot trace for every input."""
    return any(k in dynamo for k in _DATA_DEPENDENT)


def _size_from_values(dynamo: str) -> bool:
    """Whether the dynamo exporter's failure (``dynamo``) is a number read from the inputs' values (``Could not
    extract specialized integer from data-dependent expression u0``): ``.tolist()``, ``.item()`` or ``int()`` of a
    tensor used as a size, which the graph would keep at the example's value."""
    return _SIZE_FROM_VALUES in dynamo


def traced_value(said: warnings.WarningMessage) -> str:
    """``file:line`` where a TracerWarning says the trace fixed a tensor's value outside torch's own code; else
    an empty string."""
    if not issubclass(said.category, torch.jit.TracerWarning) or _TO_PYTHON not in str(said.message):
        return ""
    if Path(said.filename).resolve().is_relative_to(Path(torch.__file__).resolve().parent):
        return ""
    return f"{Path(said.filename).name}:{said.lineno}"


def traced_branch(said: warnings.WarningMessage) -> str:
    """``file:line`` where a TracerWarning says the trace turned a tensor into a Python boolean in the user's own
    code, other than in an ``assert`` (which the graph leaves out, computing the same for every input): a branch
    decided by the example's values, which the graph would take for every input; else an empty string. A number
    read (``.item()``, ``int()``: a size, a constant) is not one: :func:`traced_value` tells of those."""
    if _TO_BOOL not in str(said.message) or not traced_value(said) or not is_user_file(said.filename):
        return ""
    if linecache.getline(said.filename, said.lineno).lstrip().startswith("assert"):
        return ""
    return f"{Path(said.filename).name}:{said.lineno}"


def _from_values(model: nn.Module, example: Inputs, branches: list[str]) -> list[str]:
    """The places of ``branches`` (:func:`traced_branch`) where the truth value comes from the inputs' values, told
    by running ``model`` on ``example`` with each tensor computed from an input marked: the trace warns alike where
    the value comes from the inputs' shapes (``min(0, x.shape[1])``: traced sizes are tensors) or from the weights,
    which its graph computes for every input."""
    reads = _ValueReads()
    flat = FlatModel(model, example)
    args = tuple(tensors(example))
    reads.mark(args)
    with torch.no_grad(), reads:
        flat(*args)
    return [b for b in branches if b in reads.places]


class _ValueReads(TorchFunctionMode):
    """Marks each tensor an op computes from a marked one, and collects where the user's code takes the truth
    value of a marked tensor (``if x.sum() > 0:``), as ``file:line``."""

    def __init__(self) -> None:
        super().__init__()
        self.marked: dict[int, weakref.ref[torch.Tensor]] = {}  # by id: a tensor's == is elementwise
        self.places: set[str] = set()

    def mark(self, values: Any) -> None:
        """Mark the tensors in ``values`` (any nesting) as computed from the inputs."""
        for t in tree_leaves(values):
            if isinstance(t, torch.Tensor):
                self.marked[id(t)] = weakref.ref(t)

    def _is_marked(self, values: Any) -> bool:
        return any(
            isinstance(t, torch.Tensor) and (r := self.marked.get(id(t))) is not None and r() is t
            for t in tree_leaves(values)
        )

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        marked = self._is_marked((args, kwargs))
        if marked and func is torch.Tensor.__bool__:
            self.places.add(_user_place())
        out = func(*args, **kwargs)
        if marked:
            self.mark(out)
        return out


def _user_place() -> str:
    """``file:line`` of the innermost frame of the running code in the user's files; empty where none is."""
    frame = sys._getframe(1)
    while frame is not None and not is_user_file(frame.f_code.co_filename):
        frame = frame.f_back  # type: ignore[assignment]
    return f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}" if frame is not None else ""


def refuse_traced_branch(
    fixed: list[str],
    errors: list[str],
    validation: str = "",
    raised: Raised | None = None,
    cause: Cause | None = None,
    branches: list[str] | None = None,
) -> None:
    """After the dynamo exporter failed, the TorchScript exporter traced the model on its example and fixed the
    values Python code read from tensors at ``fixed``. Where dynamo failed because such a value decides a branch
    or a size (a data-dependent guard), the graph holds only the branch (or size) the example took and computes it
    for every input, which the parity check passes whenever the data takes that branch too: an error, naming the
    call torch's error says raised it (``raised``) where it names one (a size read where that call takes sizes; the
    user's own export first in the fix where it is a library's code), and the fix of a known ``cause``. Where that
    guard is ``torch.distributions``' argument validation (``validation``: its place), the error says so and how to
    turn it off, which lets the dynamo exporter through. Where the user's code turned a tensor into a truth value
    (``branches``: :func:`traced_branch`), the trace fixed a branch whatever dynamo said, or where it did not run
    (below opset 18): the same error. Otherwise the values may be shapes or constants: said in the log, with the
    places, since the parity check compares only the data."""
    dynamo = next((e for e in errors if e.startswith("dynamo")), "")
    named = re.search(r"\(in [\w<>]+\(\) at ([^)]+):(\d+)\)", dynamo)  # the line dynamo's error names
    at = f"{Path(named.group(1)).name}:{named.group(2)}" if named else None
    shown = [at] if at in fixed else fixed  # the branch's own line, not every shape read the trace warned of
    places = ", ".join(shown[:3]) + (f" and {len(shown) - 3} more" if len(shown) > 3 else "")
    if validation and _data_dependent(dynamo):
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
    if not _data_dependent(dynamo) and branches:
        _refuse_traced_bool(branches, dynamo, cause)
    if not _data_dependent(dynamo):
        log.warning(
            "the TorchScript exporter fixed values the model's Python code reads from tensors at %s: the graph keeps "
            "the example's values there (right for shapes and constants, wrong for a branch on the inputs' values)",
            places,
        )
        return
    places = raised.place if raised else places  # the line torch says raised the failure: the branch or size read
    if _size_from_values(dynamo):
        said = (
            f"the model reads a size from its inputs' values (.tolist(), .item() or int() of a tensor) at {places} "
            f"({dynamo}), and the TorchScript exporter traced it as the example's number: the graph would use that "
            "size for every input"
        )
    elif raised and raised.sizes():
        said = (
            f"the model sizes a tensor by a tensor's value at {places} (a size computed as a tensor, or read with "
            f".tolist(), .item() or int()) ({dynamo}), and the TorchScript exporter traced it as "
            "the example's number: the graph would use that size for every input"
        )
    else:
        said = (
            f"the model decides a branch from its inputs' values at {places} ({dynamo}), and the TorchScript "
            "exporter traced only the branch its example took: the graph would take that branch for every input"
        )
    if cause:
        raise ModelError(f"{said}; {cause.said}", hint=cause.fix)
    raise ModelError(said, hint=_values_fix(dynamo, raised))


def _refuse_traced_bool(branches: list[str], dynamo: str, cause: Cause | None) -> None:
    """Raise the error of :func:`refuse_traced_branch` for branches the user's code decided from tensors' values at
    ``branches``, where the dynamo exporter failed otherwise (``dynamo``: its failure) or did not run (empty), in
    which case the fix's torch.cond needs opset 18, the dynamo exporter's."""
    places = ", ".join(branches[:3]) + (f" and {len(branches) - 3} more" if len(branches) > 3 else "")
    why = f" ({dynamo})" if dynamo else ""
    said = (
        f"the model decides a branch from its inputs' values at {places}{why}, and the TorchScript exporter traced "
        "only the branch its example took: the graph would take that branch for every input"
    )
    if cause:
        raise ModelError(f"{said}; {cause.said}", hint=cause.fix)
    opset = "" if dynamo else " (at export.opset 18 or later, where Kiln runs the dynamo exporter)"
    raise ModelError(said, hint=f"{_BRANCH_CHANGE}{opset}, or {_OWN_EXPORT}")


def _values_fix(dynamo: str, raised: Raised | None) -> str:
    """The fix where the dynamo exporter stopped at a guard on values (``dynamo``: its failure): the size computed
    from shapes where a size was read (:func:`_size_from_values`, or ``raised`` is a call that takes sizes), else the
    branch written with tensor ops; where the line is a library's code (``raised.library``), the user's own export
    first, since that code is not theirs to change."""
    sizes = _size_from_values(dynamo) or (raised is not None and raised.sizes())
    if raised is None or not raised.library:
        return SIZE_FROM_VALUES_FIX if sizes else DATA_BRANCH_FIX
    change = _SIZE_CHANGE if sizes else _BRANCH_CHANGE
    return (
        f"that line ({raised.place}) is in {raised.library}, not your code: {_OWN_EXPORT} (with the library's own "
        f"ONNX export settings or tools where it has them); or change that code: {change}"
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


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    """``exc`` and the errors it was raised from or during, each once."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


# How torch's data-dependent errors name the call that raised them: the branch or the size read itself, the frame
# its guard was evaluated in (``Caused by: (transformers/models/x/modeling_x.py:549 in forward)``, the file relative
# to torch's folder or to the folder above it), and the call of the traced code that led there
_CAUSED_BY = re.compile(r"Caused by: \((\S+?):(\d+) in [\w<>]+\)")
_RAISED = re.compile(r'The following call raised this error:\s*File "([^"]+)", line (\d+)[^\n]*\n?([^\n]*)')
# A call that takes sizes (a view, a new tensor): where torch's error says one raised it, a size was read from a
# tensor's value there, not a branch decided
_SIZE_CALL = re.compile(
    r"\.(view|reshape|expand|new_zeros|new_ones|new_empty|new_full|repeat|narrow|unflatten|split)\("
    r"|torch\.(zeros|ones|empty|full|arange|split)\("
)
_BRANCH = re.compile(r"^(if|elif|while|assert|for)\b")


class Raised(NamedTuple):
    """The call torch's error says raised the dynamo exporter's failure (:func:`_raised_at`)."""

    place: str  # file:line, the file by its name
    code: str  # the source line, stripped; empty where it cannot be read
    library: str  # the installed library whose code it is (``transformers``); empty for the user's code

    def sizes(self) -> bool:
        """Whether the line takes sizes (a view, a reshape, a new tensor) rather than deciding a branch."""
        return not _BRANCH.match(self.code) and _SIZE_CALL.search(self.code) is not None


def _raised_at(exc: BaseException) -> Raised | None:
    """The call torch's error says raised it, the user's code or a library's, where the innermost frame in the
    user's files may be only the call into that library: the frame its guard was evaluated in (``Caused by:``,
    the ``if`` itself), else the traced call that led there (``The following call raised this error: File
    ".../modeling_mixtral.py", line 81``); None where it names neither outside torch's files."""
    torch_dir = Path(torch.__file__).resolve().parent
    for err in _chain(exc):
        caused = _CAUSED_BY.search(str(err))
        path = _source_file(caused.group(1), torch_dir, exc) if caused else None
        if caused is not None and path is not None:
            return _raised(path, int(caused.group(2)))
    for err in _chain(exc):
        found = _RAISED.search(str(err))
        if found is not None and not Path(found.group(1)).resolve().is_relative_to(torch_dir):
            return _raised(Path(found.group(1)), int(found.group(2)), found.group(3).strip())
    return None


def _source_file(named: str, torch_dir: Path, exc: BaseException) -> Path | None:
    """The file a ``Caused by:`` line names, where it is found and not one of torch's own; else None. torch names it
    relative to its own folder, to the folder above it (``transformers/models/...``), or by a path cut at the
    prefix it shares with torch's (``mp/w/lib.py`` for ``/tmp/w/lib.py``): tried against those folders and
    sys.path, then against the files of ``exc``'s tracebacks."""
    if (torch_dir / named).is_file():
        return None
    roots = [Path("/"), torch_dir.parent, *(Path(p) for p in sys.path if p)]
    found = next((root / named for root in roots if (root / named).is_file()), None)
    tail = "/" + named.split("/", 1)[-1]
    files = (f.filename for err in _chain(exc) for f in traceback.extract_tb(err.__traceback__))
    return found or next((Path(f) for f in files if f.replace(os.sep, "/").endswith(tail)), None)


def _raised(path: Path, line: int, code: str = "") -> Raised:
    """:class:`Raised` for ``path``'s line ``line``, its source read from the file where ``code`` is not given."""
    if not code:
        code = linecache.getline(str(path), line).strip()
    library = "" if is_user_file(str(path.resolve())) else _library_of(path)
    return Raised(f"{path.name}:{line}", code, library)


def _library_of(path: Path) -> str:
    """The top-level package ``path`` belongs to under an install folder (``site-packages``); "a library" where it
    lies elsewhere."""
    parts = path.resolve().parts
    found = [i for i, p in enumerate(parts) if p in ("site-packages", "dist-packages")]
    return parts[found[-1] + 1] if found and found[-1] + 1 < len(parts) - 1 else "a library"


class Cause(NamedTuple):
    """An export failure that comes from a library's setting the user chose (:func:`known_cause`): what the error
    adds to its message, and the fix, that setting changed."""

    said: str
    fix: str


def known_cause(model: nn.Module, exc: BaseException) -> Cause | None:
    """The library setting ``model``'s export failure (``exc``) comes from, where it is one no exporter writes and
    another does: QAT's fake-quantize modules observing or fused (:func:`_qat_cause`), transformers' mixture-of-experts
    layers computed by an implementation other than ``batched_mm`` (:func:`_experts_cause`), torch's transformer
    stacks reading a mask's values to tell whether it is causal (:func:`_causal_mask_cause`); else None."""
    return _qat_cause(model) or _experts_cause(model, exc) or _causal_mask_cause(exc)


# The flag of each torch transformer stack that says its mask is causal, so that it does not read the mask's values
_CAUSAL_FLAGS = {"TransformerDecoder": "tgt_is_causal", "TransformerEncoder": "is_causal"}


def _causal_mask_cause(exc: BaseException) -> Cause | None:
    """torch's ``nn.TransformerDecoder`` / ``nn.TransformerEncoder`` given a mask without its causal flag, where the
    export failure (``exc``) is raised inside ``_detect_is_causal_mask``: it compares the mask's values with a causal
    one, a branch on values the dynamo exporter cannot export (``Could not guard on data-dependent expression``).
    With the flag set (``tgt_is_causal=True``, ``is_causal=True``) the stack trusts it and reads no values."""
    check = torch.nn.modules.transformer._detect_is_causal_mask.__code__
    for err in _chain(exc):
        frames = list(_frames(err.__traceback__))
        for caller, tb in zip(frames, frames[1:]):
            if tb.tb_frame.f_code is check:
                stack = type(caller.tb_frame.f_locals.get("self")).__name__
                flag = _CAUSAL_FLAGS.get(stack, "tgt_is_causal (is_causal for an encoder)")
                return Cause(
                    f"torch's nn.{stack} reads the mask's values to tell whether it is causal, a branch on values no "
                    "graph exports",
                    f"pass {flag}=True with the causal mask: nn.{stack} then trusts the flag and reads no values, and "
                    "the dynamo exporter exports the model",
                )
    return None


def _with_cause(reason: str, cause: Cause | None) -> str:
    """The dynamo exporter's failure ``reason`` with a known ``cause``'s words and fix put before its closing place
    (``(in forward() at m.py:3)``, which later errors read as the line to change); ``reason`` where none is known."""
    if cause is None:
        return reason
    head, place = re.match(r"(.*?)((?: \(in [\w<>]+\(\) at [^)]+\))?)$", reason, re.DOTALL).groups()  # type: ignore[union-attr]
    return f"{head}: {cause.said}; {cause.fix}{place}"


def _qat_cause(model: nn.Module) -> Cause | None:
    """QAT's fake-quantize modules (``torch.ao.quantization.prepare_qat``) in ``model`` that no exporter writes: the
    fused ``FusedMovingAvgObsFakeQuantize`` (the default QAT qconfigs' since version 1: one op, observer and fake
    quantization, with no ONNX translation), and any whose observer is on (it updates its range at every forward,
    in place and behind a branch on its flag); else None. With observers off, the non-fused ``FakeQuantize`` exports
    as QuantizeLinear/DequantizeLinear."""
    quant = torch.ao.quantization
    fakes = [(n, m) for n, m in model.named_modules() if isinstance(m, quant.FakeQuantizeBase)]
    fused = [n for n, m in fakes if isinstance(m, quant.FusedMovingAvgObsFakeQuantize)]
    observing = [n for n, m in fakes if bool(m.observer_enabled[0])]
    if not fused and not observing:
        return None
    said, fix = [], []
    if fused:
        said.append(f"the fused FusedMovingAvgObsFakeQuantize (at {_some(fused)}), one op no exporter writes")
        fix.append(
            'prepare QAT with the non-fused FakeQuantize: qconfig torch.ao.quantization.get_default_qat_qconfig("x86", '
            "version=0) (the default, version 1, is the fused one)"
        )
    if observing:
        said.append(f"observers on (at {_some(observing)}), which update their ranges in place at every forward")
    fix.append(
        "call model.apply(torch.ao.quantization.disable_observer) in the model factory once the ranges are observed "
        "(or on the trained model before export): the fake-quantize modules then export as QuantizeLinear/"
        "DequantizeLinear"
    )
    return Cause(f"the model fake-quantizes for QAT with {' and '.join(said)}", "; and ".join(fix))


def _experts_cause(model: nn.Module, exc: BaseException) -> Cause | None:
    """transformers' mixture-of-experts layers (``MixtralExperts``: the classes ``@use_experts_implementation``
    dispatches) where the export failure (``exc``) is theirs: raised inside their forward (``eager``: a Python loop
    over the experts the inputs route to) or at their ``grouped_mm`` op, which has no ONNX translation. Their
    ``batched_mm`` implementation (batched matmuls over every expert) exports; None where the layers use it."""
    experts = [m for m in model.modules() if _experts_implementation(m) not in (None, "batched_mm")]
    if not experts:
        return None
    codes = {
        c
        for m in experts
        for f in (type(m).forward, getattr(type(m).forward, "__wrapped__", None))
        if (c := getattr(f, "__code__", None))
    }
    inside = any(tb.tb_frame.f_code in codes for err in _chain(exc) for tb in _frames(err.__traceback__))
    if not inside and not any("grouped_mm" in str(err) for err in _chain(exc)):
        return None
    impl = _experts_implementation(experts[0])
    return Cause(
        f"it fails in transformers' mixture-of-experts layer {type(experts[0]).__name__}, computed by "
        f"experts_implementation={impl!r}, which no exporter exports",
        'load the model with experts_implementation="batched_mm" (from_pretrained(..., experts_implementation='
        '"batched_mm"), or the model config\'s experts_implementation; on a built model, '
        'model.set_experts_implementation("batched_mm")): its batched matmuls over every expert export',
    )


def _experts_implementation(module: nn.Module) -> str | None:
    """The ``experts_implementation`` a transformers experts layer (a ``...Experts`` module whose config names one)
    computes with; None for any other module."""
    if not type(module).__name__.endswith("Experts"):
        return None
    impl = getattr(getattr(module, "config", None), "_experts_implementation", None)
    return impl if isinstance(impl, str) else None


def _frames(tb: TracebackType | None) -> Iterator[TracebackType]:
    """The traceback entries of ``tb``, outermost first."""
    while tb is not None:
        yield tb
        tb = tb.tb_next


def _some(names: list[str]) -> str:
    """``'a', 'b', 'c' and 2 more``: the first three of ``names``, quoted."""
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return ", ".join(f"'{n}'" for n in names[:3]) + more


def fallback_failed(failure: str, refused: str) -> ModelError:
    """The error where ONNX Runtime cannot load or run the graph the TorchScript exporter wrote (``failure``: how,
    in words) after the dynamo exporter failed (``refused``: why, :func:`export_with_fallback`): the graph is the
    fallback's, so the fix is what made the dynamo exporter fail, not an op of the model's."""
    return ModelError(
        f"{failure}; this graph is the TorchScript exporter's, the fallback after the dynamo exporter failed "
        f"({refused})",
        hint=_fallback_hint(refused),
    )


def _fallback_hint(refused: str) -> str:
    """The fix where the TorchScript exporter's graph fails (:func:`fallback_failed`): where the dynamo exporter
    fixed axes that signature.dynamic_axes makes vary, those axes taken out of it or the code that fixed them
    (named where torch's log told it) written with tensor ops; else the code the dynamo exporter failed on."""
    if not refused.startswith(_FIXED_AXES):
        named = re.search(r"\(in ([\w<>]+\(\) at [^)]+)\)$", refused)
        return (
            f"change the code the dynamo exporter failed on{' in ' + named.group(1) if named else ''}, so that it "
            "exports the model; or export the model yourself and give Kiln the file (model: {onnx: model.onnx})"
        )
    lost = re.findall(r" axis (\d+) \(([^)]+)\)", refused)
    places = fixed_places(refused)
    at = f" at {places}" if places else ""
    others = {label: int(axis) for axis, label in lost if axis != "0"}  # the batch is export.dynamic_batch's
    if not others:
        return f"compute the sizes the code{at} takes from the batch {BATCH_FIXED_HINT}"
    return (
        f"remove {', '.join(others)} from signature.dynamic_axes, so the model is exported at one length (pad shorter "
        f"inputs to it), which the dynamo exporter exports; or write the code that fixed it{at} with tensor ops over "
        f"the whole axis: a Python loop over it (for t in range(x.shape[{next(iter(others.values()))}])) is unrolled "
        "to the export's size (cumsum or a vectorised scan is not)"
    )


def fixed_places(refused: str) -> str:
    """``a.py:3, b.py:9 and 2 more``: where the dynamo exporter found an axis that signature.dynamic_axes makes vary
    fixed, as its failure (``refused``: :func:`export_with_fallback`'s) names them (:func:`_places`): the user's code
    or a library's; empty for another failure, or where torch's log named none."""
    if not refused.startswith(_FIXED_AXES):
        return ""
    found = re.search(r", at (.+)$", refused)
    return found.group(1) if found else ""


class ExportFailed(ModelError):
    """Both exporters failed on the model."""


def _export_failed(
    model: nn.Module,
    example: Inputs,
    errors: list[str],
    opset: int,
    axes: Mapping[str, Mapping[int, str]],
    raised: Raised | None = None,
    cause: Cause | None = None,
    places: str = "",
) -> ExportFailed:
    """The error where both exporters failed (``errors``: each one's reason), with the fix
    (:func:`_export_failed_hint`): where the dynamo exporter's one failure was fixing ``axes`` that vary, the
    line of the user's code it fixed them at (:func:`kiln.stages.export.pinned_sizes.pinned_at`), since the
    TorchScript exporter tried next fails for a reason of its own (an op it cannot write); where the failure comes
    from a library's setting (``cause``: :func:`known_cause`), that setting's fix, whatever else the errors say.
    ``raised``: the call torch's error says raised the dynamo exporter's failure (:func:`_raised_at`); ``places``:
    where torch's log said the dynamo exporter fixed the axes (:func:`fixed_places`), named where :func:`pinned_at`
    finds no line of the user's (the size is fixed inside a library, ``modeling_whisper.py:612``)."""

    fixed = f"dynamo exporter: {_FIXED_AXES}"
    line = _short_line(pinned_at(model, example, axes)) if any(e.startswith(fixed) for e in errors) else ""
    line = line or (places if any(e.startswith(fixed) for e in errors) else "")
    said = " | ".join(f"{e} (in {line})" if line and e.startswith(fixed) else e for e in errors)
    complex_values = _complex_values(model, errors)
    if complex_values:
        said += f"; ONNX has no complex tensors, and the model computes with {complex_values}"
    if cause is not None:
        return ExportFailed(f"torch.onnx.export failed: {said}; {cause.said}", hint=cause.fix)
    return ExportFailed(
        "torch.onnx.export failed: " + said, hint=_export_failed_hint(errors, opset, line, complex_values, raised)
    )


def _short_line(line: str) -> str:
    """:func:`pinned_at`'s ``forward() at /home/me/mine.py:24 (for t in range(l):)`` with the file by its name
    (``mine.py:24``), as the message's other lines say the user's code (:func:`_node_location`); as it is where it
    names no file."""
    found = re.match(r"(.*?\(\) at )(.+?)(:\d+(?: \(.*)?)$", line, re.DOTALL)
    return found.group(1) + Path(found.group(2)).name + found.group(3) if found else line


# How the dynamo exporter's failure reads where its graph fixed an axis signature.dynamic_axes makes vary
_FIXED_AXES = "it fixed "


def _complex_values(model: nn.Module, errors: list[str]) -> str:
    """The complex parameters and buffers of ``model`` (``complex weights 'w' (complex64)``), or "complex tensors"
    where it has none but an exporter's error speaks of complex values; empty otherwise: ONNX has no complex type."""
    held = [(n, t) for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_complex()]
    if held:
        names = ", ".join(f"'{n}' ({str(t.dtype).removeprefix('torch.')})" for n, t in held[:3])
        return f"complex weights {names}" + (f" and {len(held) - 3} more" if len(held) > 3 else "")
    return "complex tensors" if any("complex" in e.lower() for e in errors) else ""


COMPLEX_HINT = (
    "store each complex weight as two real tensors (its real and imaginary parts: nn.Parameter(w.real), "
    "nn.Parameter(w.imag)) and compute the complex products from them with real ops; around the FFTs turn the "
    "spectrum into a real tensor and back with torch.view_as_real / torch.view_as_complex (torch.fft.rfft2 and "
    "irfft2 then export as ONNX DFT)"
)


def _export_failed_hint(
    errors: list[str], opset: int, line: str = "", complex_values: str = "", raised: Raised | None = None
) -> str:
    """The fix where both exporters failed: a later opset where the exporter names the one its op came in
    (``Support for this operator was added in version 20``: ``AffineGrid``, ``GridSample``'s modes); where the
    dynamo exporter failed only by fixing an axis that varies, how to keep sizes symbolic (at ``line``, the user's
    code it fixed the axis in, where found), which lets it export; where it stopped at a guard on the inputs'
    values (:func:`_data_dependent`), the branch (or the size read from them: :func:`_size_from_values`) written
    with tensor ops, whatever the TorchScript exporter then failed on (its trace would hold one side of the branch
    only), at the user's line or else the one torch's error names (``raised``); where the model computes with
    complex values (``complex_values``), their rewrite as real ones; below opset 18, where only the TorchScript
    exporter runs, opset 18 where it lacked an op (the dynamo exporter writes more); where the dynamo exporter could
    not carry a size computed from the values (``Pending unbacked symbols``: nonzero inside torch.cond), the dense
    form; else an op ONNX may not express."""

    versions = [int(v) for e in errors for v in re.findall(r"added in (?:opset )?version (\d+)", e)]
    later = max((v for v in versions if v > opset), default=None)
    if later is not None:
        return f"export at the opset that has the op: --set export.opset={later} (the config's export.opset)"
    if any(e.startswith(f"dynamo exporter: {_FIXED_AXES}") for e in errors):
        fix = BRANCH_FIX if size_branch(line) else FIXED_SIZE_HINT
        return (f"in {line}, where the dynamo exporter fixed the size: " if line else "") + fix
    dynamo = next((e for e in errors if e.startswith("dynamo exporter: ")), "")
    named = re.search(r"\(in ([\w<>]+\(\) at [^)]+)\)$", dynamo)
    at = f", in {named.group(1)}" if named else f", at {raised.place}" if raised else ""
    if _UNBACKED_SIZES in dynamo:
        return (
            f"the model computes a size from its inputs' values{at} (nonzero, boolean-mask indexing, torch.unique...), "
            f"which ONNX export cannot carry here: {DENSE_FIX}"
        )
    if _data_dependent(dynamo):
        raised = None if named else raised  # the user's own line: theirs to change
        fix = _values_fix(dynamo, raised)
        if _size_from_values(dynamo) or (raised is not None and raised.sizes()):
            return f"the dynamo exporter stopped at a size read from the inputs' values{at}: {fix}"
        return f"the dynamo exporter stopped at a branch on the inputs' values{at}: {fix}"
    if complex_values:
        return COMPLEX_HINT
    if opset < 18 and any(re.search(r"to ONNX opset version \d+ is not supported", e) for e in errors):
        return (
            "export at opset 18, where Kiln runs the dynamo exporter, which writes ops the TorchScript exporter (the "
            "only one below 18) cannot: --set export.opset=18 (the config's export.opset)"
        )
    return "the model may use an op ONNX cannot express; see the message above"
