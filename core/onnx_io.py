"""Reading, checking and running ONNX models, with user-facing errors instead of library tracebacks."""

from __future__ import annotations

import functools
import logging
import math
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from kiln.core.cpu_int8 import ask_exact_int8
from kiln.core.errors import InputFileError, KilnError, ModelError
from kiln.core.inputs import check_batch_axis
from kiln.core.random_ops import RANDOM_HINT, RANDOM_OPS
from kiln.core.records import IntRange, TensorSpec, by_column, cell_text, first_outside, whole_range
from kiln.core.text import first_line

# ONNX's protobuf limit: larger models must keep their weights in external data files.
PROTOBUF_LIMIT = 2**31 - 1
_INLINE_LIMIT = 1_800_000_000  # bytes: above this, hand ORT a file with external data, not serialized bytes
STRIP_BYTES = 4096  # initializers above this are handed to shape inference and ONNX Runtime as stubs
log = logging.getLogger("kiln")


def load_onnx(path: str | Path, load_external_data: bool = True) -> onnx.ModelProto:
    p = Path(path)
    if not p.is_file():
        raise InputFileError(f"ONNX file not found: {p}", hint="check the path")
    if p.stat().st_size == 0:
        raise InputFileError(
            f"{p} is empty (0 bytes): not an ONNX model",
            hint="re-export the model; the write that made this file did not finish",
        )
    try:
        model = onnx.load(str(p), load_external_data=False)
    except Exception as exc:
        raise InputFileError(
            f"{p} is not a readable ONNX model ({type(exc).__name__}: {first_line(exc)})",
            hint="re-export the model; the file may be truncated or not ONNX",
        ) from None
    if not model.HasField("graph") or not model.graph.output:
        # protobuf parses many non-ONNX files (and truncated ones) into an empty message without complaint
        raise InputFileError(
            f"{p} is not a readable ONNX model (no graph in it: damaged, truncated or another kind of file)",
            hint="re-export the model; the file may be truncated or not ONNX",
        )
    _check_external_data(model, p)
    check_opset(model, p)
    if load_external_data:
        try:
            onnx.load_external_data_for_model(model, str(p.parent))
        except Exception as exc:
            raise InputFileError(
                f"cannot read the external weights of {p} ({first_line(exc)})",
                hint="keep the model's .data file(s) beside it, complete, as exported",
            ) from None
    return model


def check_opset(model: onnx.ModelProto, path: Path) -> None:
    """The graph's ONNX opset is one this onnx package and ONNX Runtime can run, said by its number where the file
    enters (ONNX Runtime's own refusal comes later, as a C++ function name in a one-line message)."""
    version = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if version is None:
        return
    newest = min(onnx.defs.onnx_opset_version(), ort_max_opset())
    if version > newest:
        raise ModelError(
            f"{path} uses ONNX opset {version}; this ONNX Runtime and onnx run opsets up to {newest}",
            hint=f"re-export the model with an opset up to {newest} (torch.onnx.export(..., opset_version={newest}), "
            "Kiln's export.opset), or upgrade onnxruntime and onnx",
        )


@functools.lru_cache(maxsize=1)
def ort_max_opset() -> int:
    """The newest opset ONNX Runtime loads here: found once, by loading a one-node graph at each candidate (its
    Python API does not say)."""
    low, high = 17, onnx.defs.onnx_opset_version()  # every supported ONNX Runtime runs opset 17
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if _ort_loads_opset(mid) else (low, mid - 1)
    return low


def _ort_loads_opset(version: int) -> bool:
    import onnxruntime as ort

    value = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])
    graph = onnx.helper.make_graph([onnx.helper.make_node("Identity", ["x"], ["y"])], "probe", [value], [])
    graph.output.append(onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1]))
    opsets = [onnx.helper.make_opsetid("", version)]
    model = onnx.helper.make_model(graph, opset_imports=opsets, ir_version=onnx.helper.find_min_ir_version_for(opsets))
    try:
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception:  # noqa: BLE001 - any refusal means this opset does not load
        return False
    return True


def onnx_files(path: str | Path) -> list[Path]:
    """The files an ONNX model is: ``path`` and the external-data files its tensors name (checked to be there),
    for a fingerprint that changes when only the weights beside the graph do."""
    p = Path(path)
    model = load_onnx(p, load_external_data=False)
    return [p, *sorted({p.parent / loc for loc in _external_locations(model)})]


def _external_locations(model: onnx.ModelProto) -> Iterator[str]:
    for tensor in _tensors(model.graph):
        if onnx.external_data_helper.uses_external_data(tensor):
            yield next((e.value for e in tensor.external_data if e.key == "location"), "")


def _check_external_data(model: onnx.ModelProto, path: Path) -> None:
    """Every external-data file the model names is there (a model copied without its ``.data`` file otherwise
    fails deep inside a builder), and inside the model's folder."""
    for tensor in _tensors(model.graph):
        if not onnx.external_data_helper.uses_external_data(tensor):
            continue
        location = next((e.value for e in tensor.external_data if e.key == "location"), "")
        target = path.parent / location
        if not location or Path(location).is_absolute() or ".." in Path(location).parts:
            raise InputFileError(
                f"{path}: tensor '{tensor.name}' points at external data '{location}' outside the model's folder",
                hint="re-export the model with its weights beside it",
            )
        if not target.is_file():
            raise InputFileError(
                f"{path}: the external-data file {target} holding tensor '{tensor.name}' is missing",
                hint=f"copy {location} beside {path.name} (ONNX models over 2 GB keep their "
                "weights in such files), or re-export the model",
            )


def _tensors(graph: onnx.GraphProto) -> Any:
    """Every tensor stored in ``graph``: initializers and attribute tensors, subgraphs (If/Loop bodies) included."""
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                yield from _tensors(sub)


def _graphs(graph: onnx.GraphProto) -> Any:
    """``graph`` and every subgraph in it (If/Loop/Scan bodies), outermost first."""
    yield graph
    for node in graph.node:
        for sub in _subgraphs(node):
            yield from _graphs(sub)


def _subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    """The graphs a node holds as attributes (an If's branches, a Loop's body)."""
    return [sub for attr in node.attribute for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs)]


def value_names(graph: onnx.GraphProto) -> set[str]:
    """Every value name ``graph`` uses: inputs, outputs, initializers, node inputs and outputs, subgraphs included."""
    names: set[str] = set()
    for g in _graphs(graph):
        names.update(v.name for v in (*g.input, *g.output, *g.value_info))
        names.update(t.name for t in g.initializer)
        for node in g.node:
            names.update(node.input)
            names.update(node.output)
    return names


def rename_values(graph: onnx.GraphProto, mapping: dict[str, str]) -> None:
    """Rename values everywhere they appear, all at once (with ``{a: b, b: c}`` the old ``a`` becomes ``b`` and the
    old ``b`` becomes ``c``); subgraphs read outer values by name, so they are renamed too. onnx has no such helper
    (``onnx.compose`` prefixes every name), and onnx-graphsurgeon cannot import a graph whose names clash, which is
    what this repairs."""
    for g in _graphs(graph):
        for v in (*g.input, *g.output, *g.value_info, *g.initializer):
            v.name = mapping.get(v.name, v.name)
        for node in g.node:
            node.input[:] = [mapping.get(n, n) for n in node.input]
            node.output[:] = [mapping.get(n, n) for n in node.output]


def check_onnx(model: onnx.ModelProto | str | Path, what: str = "model") -> None:
    """onnx.checker with full checks; paths are checked in place (works for > 2 GB models)."""
    try:
        onnx.checker.check_model(str(model) if isinstance(model, Path) else model, full_check=True)
    except Exception as exc:
        raise ModelError(
            f"{what} fails the ONNX checker: {first_line(exc)}",
            hint="re-export with a supported opset, or report the model to Kiln",
        ) from None


def infer_shapes(model: onnx.ModelProto, strict: bool = True) -> onnx.ModelProto:
    """ONNX shape inference (types checked, data propagated) on a copy whose big initializers carry dims but no
    data: fast, and it works for models over the 2 GB protobuf limit. Returns ``model`` itself, changed in place:
    its value_info replaced, with the sizes ONNX names for a sequence's elements left unnamed
    (:func:`_forget_sequence_symbols`). ``strict`` (a gate: export, precision): recorded shapes and types are
    checked against what inference finds, and a failure is a :class:`ModelError`. Not strict (graph passes, for
    which shapes are a help): recorded shapes are dropped first (a pass may have made them stale), and a failure is
    a warning with ``model`` unchanged."""
    light, _ = light_model(model, keep_value_info=strict)
    try:
        inferred = onnx.shape_inference.infer_shapes(light, check_type=strict, data_prop=True)
    except Exception as exc:
        if strict:
            raise ModelError(
                f"ONNX shape inference failed: {first_line(exc)}", hint=_inference_hint(model, exc)
            ) from None
        log.warning("shape inference failed (%s); passes that need shapes will skip", first_line(exc))
        return model
    del model.graph.value_info[:]
    model.graph.value_info.extend(inferred.graph.value_info)
    for out, found in zip(model.graph.output, inferred.graph.output):  # outputs declared without a type or shape
        if not out.type.HasField("tensor_type") or not out.type.tensor_type.HasField("shape"):
            out.type.CopyFrom(found.type)
    _forget_sequence_symbols(model)
    return model


def _inference_hint(model: onnx.ModelProto, exc: Exception) -> str:
    """The fix for a failed shape inference. A type error (``has unsupported type: tensor(int32)``: an op given int32
    where it takes int64 indices) is about a value's dtype, not its shape: the fix names the graph inputs of that
    dtype, whose dtype in the data (or a missing cast in ``forward``) is the usual cause."""
    found = re.search(r"typestr: tensor\((\w+)\), has unsupported type: tensor\((\w+)\)", str(exc))
    if not found:
        return "the graph has a shape mismatch; check the model's input shapes"
    wanted, bad = found.groups()
    cast = ".long()" if wanted == "int64" else f"a cast to {wanted}"
    names = [v.name for v in model.graph.input if _elem_type_name(v.type) == bad]
    if not names:
        return f"an op takes {wanted} where the graph gives it {bad}: add {cast} on that value in forward"
    listed = ", ".join(repr(n) for n in names)
    return f"input {listed} is {bad}, where an op takes {wanted}: give it as {wanted}, or call {cast} on it in forward"


def _elem_type_name(t: onnx.TypeProto) -> str:
    """The element type of a tensor type as ONNX's messages spell it (``int32``, ``float``); empty for others."""
    if not t.HasField("tensor_type") or not t.tensor_type.elem_type:
        return ""
    return onnx.TensorProto.DataType.Name(t.tensor_type.elem_type).lower()


def _forget_sequence_symbols(model: onnx.ModelProto) -> None:
    """Clear, in every value's recorded shape, each size name that ONNX's inference gave the elements of a sequence
    (the graph's inputs' own names kept). A sequence type holds one element shape, so elements of different sizes
    (a SplitToSequence of a weight into [32, 64] rows, the q and kv of a cross-attention) share a name there, which
    SequenceAt and the ops after it pass on; ONNX Runtime trusts equal names, reuses one buffer for both and fails.
    An unnamed size claims nothing."""
    graphs = list(_graphs(model.graph))
    declared = {d.dim_param for v in model.graph.input for d in _tensor_dims(v.type)}
    values = [v for g in graphs for v in (*g.value_info, *g.output)]
    named = {d.dim_param for v in values if v.type.HasField("sequence_type") for d in _tensor_dims(v.type)}
    unsound = named - declared - {""}
    for value in values:
        for dim in _tensor_dims(value.type):
            if dim.dim_param in unsound:
                dim.ClearField("dim_param")


def _tensor_dims(t: onnx.TypeProto) -> list[Any]:
    """The dims of a tensor type, or of the tensors a sequence (of sequences) of tensors holds; none for others."""
    while t.HasField("sequence_type"):
        t = t.sequence_type.elem_type
    return list(t.tensor_type.shape.dim) if t.HasField("tensor_type") else []


def random_nodes(model: onnx.ModelProto) -> list[tuple[onnx.NodeProto, list[str]]]:
    """Each node of ``model`` (in subgraphs too) that draws new numbers on every run, once, with the graph outputs
    its draws reach (none where nothing reads them). The ops of :data:`RANDOM_OPS`; a Dropout only where its
    ``training_mode`` is true or not a constant (``F.dropout(x, p, training=True)``, which both of torch's exporters
    write as a constant true) and its ratio is not a constant 0. A draw in a branch or loop body is traced from the
    op itself out through each enclosing If/Loop, so that a dead draw, or one feeding only an output no graph output
    reads, is not blamed; a branch graph held twice (both sides of an If) lists its draws once."""
    constants = _constants(model.graph)
    found: dict[tuple[str, str, tuple[str, ...]], tuple[onnx.NodeProto, list[str]]] = {}
    for node, levels in _scoped_nodes(model.graph, ((model.graph, None),)):
        if _draws(node, constants):
            key = (node.op_type, node.name, tuple(node.output))
            reached = _reached_outputs(node, levels)
            before = found[key][1] if key in found else []
            found[key] = (node, before + [o for o in reached if o not in before])
    return list(found.values())


# A graph and the node of its enclosing graph that holds it (None: the model's graph), outermost first.
_Levels = tuple[tuple[onnx.GraphProto, onnx.NodeProto | None], ...]

# Ops whose outputs depend on their input's shape only, not its values: a draw read only by them changes no output.
_SHAPE_ONLY = frozenset({"Shape", "Size"})


def _scoped_nodes(graph: onnx.GraphProto, levels: _Levels) -> Iterator[tuple[onnx.NodeProto, _Levels]]:
    """Every node of ``graph`` and of its subgraphs, each with the graphs that enclose it (:data:`_Levels`)."""
    for node in graph.node:
        yield node, levels
        for sub in _subgraphs(node):
            yield from _scoped_nodes(sub, (*levels, (sub, node)))


def _reached_outputs(start: onnx.NodeProto, levels: _Levels) -> list[str]:
    """The model's outputs that the values ``start`` writes reach: traced to the outputs of the graph it is in,
    those mapped to the outputs of the If/Loop node holding that graph (:func:`_holder_outputs`), and so on out."""
    values = [o for o in start.output if o]
    for graph, holder in reversed(levels):
        reached = _reach(graph, values)
        positions = [i for i, out in enumerate(graph.output) if out.name in reached]
        if holder is None:
            return [graph.output[i].name for i in positions]
        values = _holder_outputs(holder, graph, positions)
    return []


def _reach(graph: onnx.GraphProto, start: list[str]) -> set[str]:
    """The values of ``graph`` that ``start`` reaches through the nodes that read them (as an input, or from inside
    one of their subgraphs: then every output of that node), not through Shape/Size (:data:`_SHAPE_ONLY`)."""
    readers = _readers(graph)
    reached, todo = set(start), list(start)
    while todo:
        for node in readers.get(todo.pop(), []):
            new = [o for o in node.output if o and o not in reached and node.op_type not in _SHAPE_ONLY]
            reached.update(new)
            todo.extend(new)
    return reached


def _holder_outputs(holder: onnx.NodeProto, graph: onnx.GraphProto, positions: list[int]) -> list[str]:
    """The outputs of ``holder`` (an If, a Loop, ...) that its subgraph ``graph``'s outputs at ``positions`` become:
    an If's branch output i is its output i; a Loop body's scan output (after its condition and N carried values)
    is output i - 1; its condition or a carried value, read again by the next iteration, may reach every output, as
    may any output of another op's subgraph (a Scan's)."""
    outputs = [o for o in holder.output if o]
    if holder.op_type == "If":
        return [holder.output[i] for i in positions if i < len(holder.output) and holder.output[i]]
    carried = len(graph.input) - 2 if holder.op_type == "Loop" else len(graph.output)
    if any(i <= carried for i in positions):
        return outputs
    return [holder.output[i - 1] for i in positions if i - 1 < len(holder.output) and holder.output[i - 1]]


def refuse_random_graph(model: onnx.ModelProto, what: str, hint: str = RANDOM_HINT) -> None:
    """A ModelError naming the nodes of ``model`` (``what``, in words) whose random draws reach an output
    (:func:`random_nodes`), and those outputs: such a graph answers the same inputs otherwise on every run, so
    each check that compares an engine with it (the optimizer's safety net, the precision fallback, validation's
    gates) would fail it, and blame the engine."""
    found = [(node, outputs) for node, outputs in random_nodes(model) if outputs]
    if not found:
        return
    constants = _constants(model.graph)
    said = "; ".join(f"{_random_op(n, constants)} feeds {_outputs_text(o)}" for n, o in found[:3])
    more = f"; and {len(found) - 3} more" if len(found) > 3 else ""
    raise ModelError(
        f"{what} draws random numbers at inference ({said}{more}): it answers the same inputs differently from run "
        "to run, so no engine made from it can be checked against it",
        hint=hint,
    )


def _random_op(node: onnx.NodeProto, constants: dict[str, onnx.TensorProto | onnx.AttributeProto]) -> str:
    """The drawing node in words, its op and name: a Dropout with its training_mode, a constant true or the value
    that gives it (a graph input: true or false as the caller feeds it)."""
    name = repr(node.name or node.output[0])
    if node.op_type != "Dropout":
        return f"{node.op_type} {name}"
    if node.input[2] in constants:
        return f"Dropout with training_mode true {name}"
    return f"Dropout {name} with training_mode given by input {node.input[2]!r}"


def _outputs_text(outputs: list[str]) -> str:
    return f"output{'s' if len(outputs) > 1 else ''} {', '.join(repr(o) for o in outputs)}"


def _constants(graph: onnx.GraphProto) -> dict[str, onnx.TensorProto | onnx.AttributeProto]:
    """Every initializer (a tensor) and Constant node's value (its attribute) in ``graph`` and its subgraphs, by
    name: read as an array by :func:`_constant_array` only where asked for."""
    found: dict[str, onnx.TensorProto | onnx.AttributeProto] = {}
    for g in _graphs(graph):
        found.update((t.name, t) for t in g.initializer)
        found.update((n.output[0], n.attribute[0]) for n in g.node if n.op_type == "Constant" and n.attribute)
    return found


def _constant_array(value: onnx.TensorProto | onnx.AttributeProto) -> np.ndarray:
    if isinstance(value, onnx.AttributeProto):
        value = onnx.helper.get_attribute_value(value)
    return numpy_helper.to_array(value) if isinstance(value, onnx.TensorProto) else np.asarray(value)


def _draws(node: onnx.NodeProto, constants: dict[str, onnx.TensorProto | onnx.AttributeProto]) -> bool:
    """Whether ``node`` draws new numbers on every run (:func:`random_nodes`)."""
    if node.op_type not in RANDOM_OPS:
        return False
    if node.op_type != "Dropout":
        return True
    if len(node.input) < 3 or not node.input[2]:  # no training_mode: inference (opset 12+; before, always)
        return False
    mode, ratio = constants.get(node.input[2]), constants.get(node.input[1]) if node.input[1] else None
    if ratio is not None and not _constant_array(ratio).any():
        return False
    return mode is None or bool(_constant_array(mode).any())


def _readers(graph: onnx.GraphProto) -> dict[str, list[onnx.NodeProto]]:
    """Value name -> the nodes of ``graph`` that read it, as an input or from inside one of their subgraphs."""
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        names = set(node.input).union(*(value_names(sub) for sub in _subgraphs(node))) - {""}
        for name in names:
            readers.setdefault(name, []).append(node)
    return readers


# Tensor types ONNX Runtime takes from numpy arrays as external initializers.
_SHAREABLE = {
    onnx.TensorProto.FLOAT,
    onnx.TensorProto.FLOAT16,
    onnx.TensorProto.DOUBLE,
    onnx.TensorProto.INT8,
    onnx.TensorProto.UINT8,
    onnx.TensorProto.INT16,
    onnx.TensorProto.UINT16,
    onnx.TensorProto.INT32,
    onnx.TensorProto.UINT32,
    onnx.TensorProto.INT64,
    onnx.TensorProto.UINT64,
    onnx.TensorProto.BOOL,
}
STUB_LOCATION = "__kiln_stub__"  # the external-data location of a stubbed initializer: names no file


def light_model(
    model: onnx.ModelProto, keep_value_info: bool = True, with_data: bool = False
) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """A copy of ``model`` whose big initializers (over 4 KB, held in memory) are stubs: name, type and dims, marked
    external under a location that names no file. Shape inference and the checker read nothing else; serializing
    the copy costs kilobytes where the model costs its weights. ``with_data``: the stubs' data too, as arrays for
    ONNX Runtime's external initializers (tensors of types it cannot take from numpy then stay in the copy)."""
    light = _without_initializers(model, keep_value_info)
    weights: dict[str, np.ndarray] = {}
    for init in model.graph.initializer:
        t = light.graph.initializer.add()
        big = tensor_bytes(init) > STRIP_BYTES and init.data_location != onnx.TensorProto.EXTERNAL
        if not big or (with_data and init.data_type not in _SHAREABLE):
            t.CopyFrom(init)
            continue
        t.CopyFrom(stub_tensor(init.name, init.data_type, init.dims))
        if with_data:
            weights[init.name] = np.ascontiguousarray(numpy_helper.to_array(init))
    return light, weights


def stub_tensor(name: str, data_type: int, dims: Any) -> onnx.TensorProto:
    """A tensor with a name, type and dims and no data, marked external under :data:`STUB_LOCATION`: what shape
    inference reads of a weight, and what ONNX Runtime fills from an external initializer of that name."""
    stub = onnx.TensorProto(name=name, data_type=data_type, dims=list(dims))
    stub.data_location = onnx.TensorProto.EXTERNAL
    stub.external_data.add(key="location", value=STUB_LOCATION)
    return stub


def _without_initializers(model: onnx.ModelProto, keep_value_info: bool) -> onnx.ModelProto:
    """A copy of ``model`` without its initializers, built field by field so the weights are never copied."""
    shell = onnx.ModelProto()
    _copy_fields(model, shell, skip=("graph",))
    _copy_fields(model.graph, shell.graph, skip=("initializer",) if keep_value_info else ("initializer", "value_info"))
    return shell


def _copy_fields(src: Any, dst: Any, skip: tuple[str, ...]) -> None:
    for field, value in src.ListFields():
        if field.name in skip:
            continue
        if hasattr(value, "extend"):  # repeated field
            getattr(dst, field.name).extend(value)
        elif hasattr(value, "ListFields"):  # sub-message
            getattr(dst, field.name).CopyFrom(value)
        else:
            setattr(dst, field.name, value)


def save_onnx(model: onnx.ModelProto, path: Path, external: bool = False) -> None:
    """Write ``model`` to ``path``; weights go to ``<path>.data`` when ``external`` or when the model would exceed the
    protobuf limit. The data file of the model being replaced goes with it (onnx would append to it, and one left
    beside a model that no longer references it is dead weight); a ``<path>.data`` that some other file owns is never
    touched, and when this model needs that name the save is refused."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = path.with_name(path.name + ".data")
    needs_data = external or model_bytes(model) > PROTOBUF_LIMIT
    if data.exists():
        if _references(path, data.name):
            data.unlink()
        elif needs_data:
            raise InputFileError(
                f"{data} exists and is not the external data of {path.name}: Kiln does not overwrite "
                "files it did not write",
                hint="move that file, or write the model elsewhere (-o)",
            )
    if needs_data and _mark_external(model, data.name):  # none marked (every tensor small): no data file at all
        # created as open() creates files (0666 less the umask), not as onnx's writer does (0600): a server running
        # as another user reads the weights as it reads the graph
        os.close(os.open(data, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    onnx.save_model(model, str(path))  # appends the marked tensors to their location beside ``path``


def metadata_value(model: onnx.ModelProto, key: str) -> str | None:
    """The value of ``key`` in the model's own metadata (``metadata_props``), or None where it has none."""
    return next((p.value for p in model.metadata_props if p.key == key), None)


def set_metadata(path: Path, key: str, value: str) -> None:
    """Set ``key`` of the ONNX file's own metadata to ``value`` (replacing any earlier one), rewriting only the
    file's protobuf: weights it keeps in external files are neither read nor moved, so their references hold."""
    shell = onnx.load(str(path), load_external_data=False)
    kept = [p for p in shell.metadata_props if p.key != key]
    del shell.metadata_props[:]
    shell.metadata_props.extend(kept)
    shell.metadata_props.add(key=key, value=value)
    staged = path.with_name(f".{path.name}.{os.getpid()}.metadata")
    staged.write_bytes(shell.SerializeToString())
    os.replace(staged, path)  # whole or not at all: a reader never sees a half-written graph


def _mark_external(model: onnx.ModelProto, location: str, threshold: int = 1024) -> int:
    """Mark every initializer of ``threshold`` bytes or more as stored in ``location``, which
    :func:`onnx.save_model` then writes beside the model, and return how many were marked. onnx's own
    ``save_as_external_data`` refuses a location that exists relative to the current folder rather than the
    model's, so a ``model.onnx.data`` where the user stands would stop a save into another folder."""
    marked = 0
    for tensor in (t for g in _graphs(model.graph) for t in g.initializer):
        if tensor.HasField("raw_data") and len(tensor.raw_data) >= threshold:
            onnx.external_data_helper.set_external_data(tensor, location)
            marked += 1
    return marked


def _references(path: Path, location: str) -> bool:
    """Whether the ONNX file at ``path`` keeps tensors in the external file ``location`` (beside it)."""
    try:
        shell = onnx.load(str(path), load_external_data=False)
    except Exception:  # missing, or not ONNX: it owns nothing
        return False
    return any(
        entry.key == "location" and entry.value == location
        for init in shell.graph.initializer
        if init.data_location == onnx.TensorProto.EXTERNAL
        for entry in init.external_data
    )


def tensor_bytes(tensor: onnx.TensorProto, external: bool = False) -> int:
    """The bytes a tensor's data takes in the protobuf, from its dims and type: protobuf's own ``ByteSize()``
    encodes the message to count it (a second as long as serializing a BERT-base), this reads two fields.
    ``external``: a tensor kept in an external file counts its bytes there too (where the weights are, not what the
    protobuf holds)."""
    if tensor.data_location == onnx.TensorProto.EXTERNAL and not external:
        return 0
    if tensor.data_type == onnx.TensorProto.STRING:
        return sum(len(s) for s in tensor.string_data)
    numel = int(np.prod(tensor.dims, dtype=np.int64))
    bits = {onnx.TensorProto.INT4: 4, onnx.TensorProto.UINT4: 4}.get(tensor.data_type)
    if bits is not None:
        return (numel * bits + 7) // 8
    try:
        return numel * np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)).itemsize
    except (KeyError, TypeError, ValueError):  # a type numpy has no dtype for: count the bytes it holds
        return len(tensor.raw_data)


def model_bytes(model: onnx.ModelProto) -> int:
    """About what ``model`` takes serialized: its tensors' data (:func:`tensor_bytes`, subgraphs included) and a
    generous allowance per node. Cheap; used to decide between bytes in memory and a file with external data."""
    nodes = sum(len(g.node) for g in _graphs(model.graph))
    return sum(tensor_bytes(t) for t in _tensors(model.graph)) + 1024 * nodes + (1 << 20)


OPTIMIZATION_LEVELS = ("none", "basic", "extended", "all")
# ONNX Runtime's severities: 0 verbose, 1 info, 2 warning, 3 error, 4 fatal.
ORT_SEVERITY_FOR_DEBUG, ORT_SEVERITY_QUIET = 2, 4


def ort_log_severity() -> int:
    """ONNX Runtime's log severity under Kiln's logger, applied to every session and to ORT's default logger.

    ORT's Python API has no log callback (only the C API's custom logger), so its lines cannot be re-emitted
    through ``logging``; what can be routed is its threshold. Kiln at DEBUG (``-v``): ORT's warnings and errors
    print. Otherwise only fatal lines: every ORT failure that matters reaches Kiln as an exception carrying ORT's
    message (a KilnError, or a failed autotune trial's ``error``), while the ERROR lines ORT prints for work it
    recovers from (cuDNN frontend's "No execution plans support the graph" while searching, a candidate that
    cannot run a shape) would put red error lines on a successful build."""
    import onnxruntime as ort

    debug = logging.getLogger("kiln").getEffectiveLevel() <= logging.DEBUG
    severity = ORT_SEVERITY_FOR_DEBUG if debug else ORT_SEVERITY_QUIET
    ort.set_default_logger_severity(severity)  # the environment's logger (EP factories, cuDNN frontend)
    return severity


def session_options(
    threads: int = 0,
    inter_threads: int = 0,
    parallel: bool = False,
    optimization: str = "all",
    optimized_path: Path | None = None,
    spinning: bool = True,
) -> Any:
    """ONNX Runtime session options, the one place they are made. ``optimized_path``: ORT writes the model it
    optimized there (offline optimization). ``spinning=False``: the thread pools block between calls instead of
    busy-waiting for the next one, which suits an engine that shares its cores (a server's stub beside Triton's
    threads and other stubs): ORT's default keeps its threads spinning after every call."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = inter_threads
    opts.execution_mode = ort.ExecutionMode.ORT_PARALLEL if parallel else ort.ExecutionMode.ORT_SEQUENTIAL
    opts.log_severity_level = ort_log_severity()
    opts.graph_optimization_level = {
        "none": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }[optimization]
    if optimized_path is not None:
        opts.optimized_model_filepath = str(optimized_path)
    if not spinning:
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        opts.add_session_config_entry("session.inter_op.allow_spinning", "0")
    return ask_exact_int8(opts)  # exact INT8 GEMMs on an x86 CPU without VNNI (kiln.core.cpu_int8)


def ort_session(
    model: onnx.ModelProto | str | Path,
    threads: int = 0,
    providers: list[Any] | None = None,
    optimization: str = "all",
    options: Any = None,
    error: type[KilnError] = ModelError,
) -> Any:
    """An ONNX Runtime session: the one factory. ``options`` (from :func:`session_options`) wins over
    ``threads``/``optimization``. A ModelProto goes to ORT as its graph with the big weights handed over as arrays
    (no serialized copy of them); one still near the protobuf limit, as a file with external data.
    A failure is ``error`` naming ORT's reason."""
    import onnxruntime as ort

    if optimization == "all" and isinstance(model, onnx.ModelProto) and holds_float8(model):
        optimization = "basic"  # ORT's extended optimizations miscompute FP8 Q/DQ convolutions (precision/gate.py)
    opts = options if options is not None else session_options(threads, optimization=optimization)
    providers = providers or ["CPUExecutionProvider"]
    weights: dict[str, np.ndarray] = {}
    if isinstance(model, onnx.ModelProto) and not opts.optimized_model_filepath:
        # The weights go to ORT as arrays and the graph as a few kilobytes: no serialized copy of the weights
        model, weights = light_model(model, with_data=True)
        weights = _used_weights(model, weights)
    try:
        values = [ort.OrtValue.ortvalue_from_numpy(a) for a in weights.values()]
        if weights:
            opts.add_external_initializers(list(weights), values)
        sess = _ort_session(model, opts, providers)
        sess.kiln_weights = values  # ORT may read the weights from these buffers while the session lives
        return sess
    except Exception as exc:
        raise error(
            f"ONNX Runtime cannot load the model: {first_line(exc)}",
            hint="an op or type may be unsupported by ONNX Runtime; try another opset",
        ) from None


FLOAT8_TYPES = (onnx.TensorProto.FLOAT8E4M3FN, onnx.TensorProto.FLOAT8E4M3FNUZ, onnx.TensorProto.FLOAT8E5M2)


def holds_float8(model: onnx.ModelProto) -> bool:
    """Whether the graph stores float8 tensors (an FP8 Q/DQ graph's weights and zero points)."""
    return any(t.data_type in FLOAT8_TYPES for t in model.graph.initializer)


def _used_weights(model: onnx.ModelProto, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The weights some node (or subgraph) reads or the graph outputs; the others leave the light graph too. ONNX
    Runtime drops an initializer nothing reads when it loads the graph, and then refuses to be handed its data."""
    used = {o.name for o in model.graph.output}
    graphs = [model.graph]
    while graphs:
        g = graphs.pop()
        for n in g.node:
            used.update(n.input)
            graphs += [a.g for a in n.attribute if a.type == onnx.AttributeProto.GRAPH]
            graphs += [sub for a in n.attribute if a.type == onnx.AttributeProto.GRAPHS for sub in a.graphs]
    unused = [k for k in weights if k not in used]
    if unused:
        kept = [t for t in model.graph.initializer if t.name not in unused]
        del model.graph.initializer[:]
        model.graph.initializer.extend(kept)
    return {k: v for k, v in weights.items() if k in used}


def _ort_session(model: onnx.ModelProto | str | Path, opts: Any, providers: list[Any]) -> Any:
    import onnxruntime as ort

    if not isinstance(model, onnx.ModelProto):
        return ort.InferenceSession(str(model), opts, providers=providers)
    if model_bytes(model) > _INLINE_LIMIT:  # weights ORT cannot take as arrays
        with tempfile.TemporaryDirectory(prefix="kiln-ort-") as tmp:
            path = Path(tmp) / "model.onnx"
            save_onnx(model, path, external=True)
            return ort.InferenceSession(str(path), opts, providers=providers)
    return ort.InferenceSession(model.SerializeToString(), opts, providers=providers)


def ort_run(session: Any, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    return session.run(None, feed)


def io_specs(model: onnx.ModelProto) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The graph's real inputs (initializers listed as inputs left out) and its outputs."""

    def spec(v: onnx.ValueInfoProto) -> TensorSpec:
        if not v.type.HasField("tensor_type") or not v.type.tensor_type.elem_type:  # a sequence or map output
            return TensorSpec(name=v.name, shape=[], dtype=v.type.WhichOneof("value") or "unknown")
        t = v.type.tensor_type
        shape: list[int | str] = [d.dim_param or d.dim_value for d in t.shape.dim]
        return TensorSpec(name=v.name, shape=shape, dtype=onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name)

    inits = {i.name for i in model.graph.initializer}
    return [spec(v) for v in model.graph.input if v.name not in inits], [spec(v) for v in model.graph.output]


_NOT_TENSORS = {
    "sequence_type": "a sequence",
    "map_type": "a map",
    "optional_type": "an optional",
    "sparse_tensor_type": "a sparse tensor",
}


def value_type(t: onnx.TypeProto) -> str:
    """A value's ONNX type as ONNX Runtime writes it: ``tensor(float)``, ``seq(map(int64,tensor(float)))``."""
    kind = t.WhichOneof("value")
    if kind in ("tensor_type", "sparse_tensor_type"):
        elem = onnx.TensorProto.DataType.Name(getattr(t, kind).elem_type).lower()
        return f"{kind.removesuffix('_type')}({elem})"
    if kind == "sequence_type":
        return f"seq({value_type(t.sequence_type.elem_type)})"
    if kind == "optional_type":
        return f"optional({value_type(t.optional_type.elem_type)})"
    if kind == "map_type":
        key = onnx.TensorProto.DataType.Name(t.map_type.key_type).lower()
        return f"map({key},{value_type(t.map_type.value_type)})"
    return "undefined"


def check_tensor_io(model: onnx.ModelProto, what: str, sequence_outputs: bool = False) -> None:
    """Every graph input and output of ``model`` is a tensor: engines are fed and answer numpy arrays, and the
    accuracy checks compare arrays. A ModelError names the first that is a sequence, map, optional or sparse tensor
    (a scikit-learn classifier's ZipMap output, a sequence of maps). ``sequence_outputs``: outputs that are
    sequences of tensors are taken too: the optimizer's reading (it keeps and compares them). Every other reading
    needs inputs that share a batch axis (:func:`~kiln.core.inputs.check_batch_axis`: the stages and direct commands
    that batch, slice and repeat inputs take a graph through here first); the optimizer runs a graph at sizes of its
    own and slices nothing, so a time-major RNN file (``x [5, N, 2]`` beside ``h0 [1, N, 3]``) is its to rewrite."""
    inits = {i.name for i in model.graph.initializer}
    values = [("input", v) for v in model.graph.input if v.name not in inits]
    for role, value in [*values, *(("output", v) for v in model.graph.output)]:
        kind = value.type.WhichOneof("value")
        if kind not in _NOT_TENSORS:
            continue
        if sequence_outputs and role == "output" and value.type.sequence_type.elem_type.HasField("tensor_type"):
            continue
        raise ModelError(
            f"{what}: {role} '{value.name}' is {_NOT_TENSORS[kind]} of type {value_type(value.type)}, not a tensor: "
            "Kiln's engines, checks and graph rewrites handle tensors only",
            hint=_not_tensor_hint(model, role, value.name),
        )
    if not sequence_outputs:
        check_batch_axis(io_specs(model)[0], what)


def _not_tensor_hint(model: onnx.ModelProto, role: str, name: str) -> str:
    if role == "input":
        return "export the model with tensor inputs only (an engine is fed one numpy array per input)"
    drop = f"drop output '{name}' (onnx.utils.extract_model with the other outputs)"
    if any(n.op_type == "ZipMap" and name in n.output for n in model.graph.node):
        return f"export the classifier without ZipMap (skl2onnx: options={{'zipmap': False}}), or {drop}"
    return f"export the model with tensor outputs only, or {drop}"


# ops whose output holds the values of their first input (reshaped, reordered or repeated): an index keeps its
# meaning; and a Cast to an integer type as wide as any index (a narrower one wraps values: a hashing trick, not an
# index)
_KEEPS_VALUES = {"Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Expand", "Transpose", "Tile"}
_WIDE = {onnx.TensorProto.INT32, onnx.TensorProto.INT64, onnx.TensorProto.UINT32, onnx.TensorProto.UINT64}
_INTEGER = _WIDE | {onnx.TensorProto.INT8, onnx.TensorProto.INT16, onnx.TensorProto.UINT8, onnx.TensorProto.UINT16}
# float inputs whose values index once cast to a wide integer (a diffusion model's timestep ``t.long()``)
_FLOATS = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE, onnx.TensorProto.BFLOAT16}
# ops whose input 1 holds positions along an axis (or, for the ND ones, several axes) of their input 0
_INDEXES = {"Gather", "GatherElements", "ScatterElements", "Scatter", "GatherND", "ScatterND"}
_NO_LIMIT = float("inf")

Rows = tuple[int, np.ndarray | None, str]  # axis, the rows of it an output holds (None: all), the output
Shifted = tuple[np.ndarray, int]  # a constant added to an index (one value, or one per column), the positions indexed
# for each axis of a value followed from a graph input, the input's axis it is (None: one of its own, an index's);
# None: the value's shape is not followed
Axes = list[int | None] | None


def index_ranges(model: onnx.ModelProto) -> dict[str, IntRange]:
    """Integer graph input -> ``[0, n - 1]``: the input's values reach the indices of an op that reads positions
    along an axis of ``n`` (known in the graph), through ops that keep values; ``n`` is the smallest such axis. A
    float input reaches them only through a ``Cast`` to a wide integer (a diffusion model's timestep looked up in a
    table, ``emb(t.long())``): its values, truncated as the Cast truncates them, take the same range. ONNX's
    index ops take a negative index as counted from the end, where ``torch.nn.Embedding``, ``torch.gather`` and
    ``scatter_add_`` refuse it, and ONNX Runtime stops at an index past the end with a traceback from deep in the
    graph: a server that knows the range refuses such a request, naming the input, instead. An input that reaches
    no such op has no range.

    The ops, with the axis read (:meth:`_IndexGraph.indexed`): ``Gather`` over an initializer of two or more
    dimensions (an embedding; a 1-D table is a lookup of constants, not rows) or over a computed tensor of two or
    more dimensions, at ``axis``; ``GatherElements``, ``ScatterElements`` (a graph neural network's messages:
    ``torch.gather``, ``scatter_add_``, an ``edge_index`` input) at ``axis``; ``GatherND`` and ``ScatterND``, whose
    index's last axis addresses several dims of the data, one per column: the largest of them, as the one range of
    the whole input (the smallest would refuse a valid index into a larger dim). A dim that is not a number in the
    graph (a dynamic axis, or one shape inference cannot find) gives no range: the data decides it at each call.
    Values are followed through a Gather of constant positions along an axis whose size is not a number (a batch of
    one unwrapped, ``edge_index[0]``) and through a Concat with constants within the indexed axis (a GNN's self
    loops, ``torch.cat([src, torch.arange(n)])``; classifier-free guidance's null class, ``torch.cat([y,
    torch.full_like(y, k)])``: a ``ConstantOfShape`` or an ``Expand`` of a constant).

    An input taken apart row by row (``edge_index[:, 0]`` and ``edge_index[:, 1]``: a ``Gather`` of a constant
    row, a ``Slice``, a ``Split``, along one axis of static size) holds in each row the values that row's ops
    take: the input's range is that of its most permissive row, and none where some row reaches no index op (its
    values may be anything: a count beside the ids of a category). Where those rows are the columns of the input's
    last axis and index axes of different sizes (a recommender's categorical ids packed in one ``[batch, 6]`` input,
    ``sparse[:, i]`` into table ``i``), the input gets one ``[0, n_i - 1]`` per column instead (:data:`IntRange`):
    the most permissive row would let an id past a small table through to ONNX Runtime. Rows taken apart along an
    axis before the last, every axis after it fixed (DLRM's multi-hot ids ``[batch, 4, 3]``, 3 ids for each of 4
    tables, ``sparse[:, i]``), give one per cell of those axes, flattened: cell ``i * 3 + j`` takes table ``i``'s.

    An index shifted by a constant ``c`` on its way (an ``Add`` or ``Sub``: ``ids - 1``; categorical columns that
    share one embedding, each shifted to its own rows, ``emb(x_cat + offsets)``) takes the values that keep it within
    the axis: ``[-c, n - 1 - c]``, one per column where ``c`` holds one number per column of the input's last axis
    (alike in every row of a range per cell); an input that also indexes as it is takes only the values both
    allow."""
    return _IndexGraph(model).ranges()


class _IndexGraph:
    """What :func:`index_ranges` reads of a graph: its values' producers and consumers, constants, and shapes
    (declared, from the initializers, and from ONNX shape inference on a copy without weights, run once, where
    needed: an embedding's rows need none)."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        graph = model.graph
        self.tables = {i.name: list(i.dims) for i in graph.initializer}
        self.producer = {out: node for node in graph.node for out in node.output}
        self.consumers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
        for node in graph.node:
            for slot, name in enumerate(node.input):
                self.consumers.setdefault(name, []).append((node, slot))
        self.declared = {v.name: _dims(v) for v in graph.input}
        self._inferred: dict[str, list[int | None] | None] | None = None

    def ranges(self) -> dict[str, IntRange]:
        out: dict[str, IntRange] = {}
        for value in self.model.graph.input:
            if value.name in self.tables or value.type.tensor_type.elem_type not in _INTEGER | _FLOATS:
                continue
            found = self.allowed(value.name)
            if found is not None:
                out[value.name] = found
        return out

    def allowed(self, name: str) -> IntRange | None:
        """The values input ``name`` may hold: 0 to :meth:`limit` - 1 where its values index as they are, and within
        what each constant added on the way leaves of the axis it then indexes (:meth:`shift`: ``x + c`` into ``n``
        positions takes ``-c`` to ``n - 1 - c``); one range per column (or cell) where they differ. None where nothing
        bounds it, or the bounds leave no value (a reading of the graph that cannot be right)."""
        shape = self.declared.get(name)
        sizes, parts, shifts = self.reach(name, shape)
        n = np.atleast_1d(np.asarray(self.limit(shape, sizes, parts), float))
        low, high = np.where(n == _NO_LIMIT, -_NO_LIMIT, 0.0), n - 1
        for shift, rows in shifts:
            if low.size % shift.size == 0:  # one per column of the last axis: alike in every row's cells
                shift = np.tile(shift, low.size // shift.size)
            if shift.size == low.size or low.size == 1:
                low, high = np.maximum(low, -shift), np.minimum(high, rows - 1 - shift)
        if not np.isfinite(high).all() or (low > high).any():
            return None
        pairs = [[int(a), int(b)] for a, b in zip(low, high)]
        return pairs if len({tuple(p) for p in pairs}) > 1 else pairs[0]

    def limit(self, shape: list[int | None] | None, sizes: list[int], parts: list[Rows]) -> float | list[float]:
        """The number of positions the values of an input (of ``shape``; its :meth:`reach`: ``sizes``, ``parts``)
        may address: the smallest axis its whole values index; for rows taken apart along an axis, each row's own
        smallest, and the largest over the rows (every row must be taken, else a row's values are free: no limit).
        Rows taken apart along one axis only (past the batch, every axis after it fixed), every one indexing and not
        all alike, give one number per cell of that axis and those after it, flattened: per column where it is the
        last (see :func:`index_ranges`)."""
        limit = min(sizes, default=_NO_LIMIT)
        by_axis: dict[int, list[tuple[np.ndarray, float]]] = {}
        for axis, rows, out in parts:
            by_axis.setdefault(axis, []).append((rows, min(self.reach(out, None)[0], default=_NO_LIMIT)))
        per_cell = None
        for axis, taken in by_axis.items():
            per_row = np.full(shape[axis], _NO_LIMIT)  # type: ignore[index]
            for rows, n in taken:
                per_row[rows] = np.minimum(per_row[rows], n)
            limit = min(limit, float(per_row.max()))
            after = shape[axis + 1 :]  # type: ignore[index]
            if len(by_axis) == 1 and axis > 0 and all(isinstance(d, int) and d > 0 for d in after):
                # what the whole input indexes bounds every row; a row's cells are those of the fixed axes after it
                per_cell = np.repeat(np.minimum(per_row, limit), math.prod(after))
        if per_cell is not None and limit != _NO_LIMIT and len(set(per_cell.tolist())) > 1:
            return per_cell.tolist()
        return limit

    def reach(self, start: str, shape: list[int | None] | None) -> tuple[list[int], list[Rows], list[Shifted]]:
        """The sizes of the axes the values of ``start`` index, following ops that keep values; with ``shape`` (the
        start's own), also the rows of it that ops take apart, while the value followed still has the start's axes
        (``Identity``, a wide ``Cast``, a Gather along an axis whose size is not a number: :meth:`unwrapped`): see
        :meth:`rows`. A Concat with constants within the indexed axis keeps the values' meaning (:meth:`mixed`).
        Last, each constant added to the values on the way (:meth:`shift`) with the smallest axis the sum indexes."""
        sizes: list[int] = []
        parts: list[Rows] = []
        shifts: list[Shifted] = []
        todo: list[tuple[str, Axes, int]] = [(start, None if shape is None else list(range(len(shape))), 0)]
        seen = {start}
        while todo:
            name, axes, need = todo.pop()
            view = None if axes is None or shape is None else [None if a is None else shape[a] for a in axes]
            for node, slot in self.consumers.get(name, []):
                taken = [(_start_axis(axes, a), r, out) for a, r, out in self.rows(node, view)] if slot == 0 else []
                cast = node.op_type == "Cast" and cast_to(node) in _WIDE
                unwrapped = self.unwrapped(node, view, axes) if slot == 0 else None
                if slot == 0 and (node.op_type in _KEEPS_VALUES or cast):
                    keeps = cast or node.op_type == "Identity"
                    follow = [(node.output[0], axes if keeps else None, need)]
                elif slot == 0 and taken and all(rows is None for _, rows, _ in taken):  # a slice of everything
                    follow = [(out, axes, need) for _, _, out in taken]
                elif unwrapped is not None:
                    follow = [(node.output[0], unwrapped, need)]
                elif node.op_type == "Concat" and (extra := self.mixed(node, name)) is not None:
                    follow = [(node.output[0], None, max(need, extra))]
                elif not need and (shift := self.shift(node, slot, view, axes, shape)) is not None:
                    rows = min(self.reach(node.output[0], None)[0], default=None)
                    shifts.extend([(shift, rows)] if rows else [])
                    continue
                elif slot == 1 and node.op_type in _INDEXES:
                    n = self.indexed(node)
                    sizes.extend([n] if n and n >= need else [])  # constants mixed in past the axis: not its ids
                    continue
                else:
                    parts.extend(taken)
                    continue
                for out, kept_axes, at_least in follow:
                    if out not in seen:
                        seen.add(out)
                        todo.append((out, kept_axes, at_least))
        return sizes, parts, shifts

    def shift(
        self, node: onnx.NodeProto, slot: int, view: list[int | None] | None, axes: Axes, start: list[int | None] | None
    ) -> np.ndarray | None:
        """What ``node`` adds to its input ``slot``, a value followed from a graph input (of shape ``start``; the
        value's axes ``axes`` of it, of sizes ``view``), where ``node`` is an Add or Sub of a constant: one number,
        or one per column of the input's last axis (an offset per categorical column into one table the columns
        share, ``emb(x_cat + offsets)``). None for any other node, a constant broadcast along another axis, and a
        Sub from a constant (``c - x`` reverses the values)."""
        if node.op_type not in {"Add", "Sub"} or len(node.input) != 2 or (node.op_type == "Sub" and slot != 0):
            return None
        values = self.constant(node.input[1 - slot])
        if values is None or not values.size:
            return None
        sign = -1 if node.op_type == "Sub" else 1
        if values.size == 1:
            return sign * values
        dims = self.shape(node.input[1 - slot])
        if not view or axes is None or start is None or dims is None or len(dims) > len(view):
            return None
        last = axes[-1] == len(start) - 1 and view[-1] == values.size
        return sign * values if last and dims[-1] == values.size and all(d == 1 for d in dims[:-1]) else None

    def unwrapped(self, node: onnx.NodeProto, view: list[int | None] | None, axes: Axes) -> Axes | None:
        """The start's axes that the output of ``node`` keeps, where ``node`` is a Gather of constant positions along
        an axis of ``view`` whose size is not a number (``edge_index[0]`` of a batch of one: the batch axis): its
        values pass through unchanged, and positions along such an axis are alike (samples), so the rows of the
        start's other axes are still followed. None for any other node (not followed this way)."""
        if node.op_type != "Gather" or view is None or axes is None or self.constant(node.input[1]) is None:
            return None
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        axis = int(attrs.get("axis", 0))
        if not -len(view) <= axis < len(view) or view[axis]:
            return None
        axis %= len(view)
        picked = self.shape(node.input[1])
        return None if picked is None else [*axes[:axis], *([None] * len(picked)), *axes[axis + 1 :]]

    def mixed(self, node: onnx.NodeProto, name: str) -> int | None:
        """For a Concat of ``name`` with other inputs that are all integer constants, a ``Range`` of constants
        (``torch.cat([src, torch.arange(n)])``: a GNN's self loops) or filled with a constant (:meth:`bounds`), the
        smallest number of positions an indexed axis must have to take those constants too (the values keep their
        meaning only within it); None where an other input's values are not known."""
        need = 0
        for other in node.input:
            if other == name:
                continue
            bounds = self.bounds(other)
            if bounds is None:
                return None
            if bounds:
                low, high = bounds
                need = max(need, high + 1, -low)
        return need

    def bounds(self, name: str) -> tuple[int, int] | tuple[()] | None:
        """The smallest and largest integer ``name`` holds where it is a constant (:meth:`constant`), a ``Range``
        of constants, or a tensor of a computed shape filled with a constant (:meth:`filled`: ``torch.full_like(y,
        k)``); ``()`` where it holds none; None where not known."""
        values = self.constant(name)
        if values is None:
            values = self.filled(name)
        if values is not None:
            return (int(values.min()), int(values.max())) if values.size else ()
        node = self.producer.get(name)
        if node is None or node.op_type != "Range":
            return None
        ends = [self.constant(i) for i in node.input]
        if any(e is None or e.size != 1 for e in ends):
            return None
        start, limit, delta = (int(e[0]) for e in ends)  # type: ignore[index]
        count = max(0, -(-(limit - start) // delta)) if delta else 0
        if not count:
            return ()
        last = start + delta * (count - 1)
        return min(start, last), max(start, last)

    def filled(self, name: str) -> np.ndarray | None:
        """The integer constant ``name`` is filled with where it is a ``ConstantOfShape`` of an integer value or an
        ``Expand`` of an integer constant (each reshaped or cast as :meth:`constant` follows), else None. Its shape
        may be computed (the batch's): only its values matter to an index."""
        name, node = traced_back(name, self.producer, _keeps_integers)
        if node is not None and node.op_type == "Expand":
            return self.constant(node.input[0])
        if node is None or node.op_type != "ConstantOfShape":
            return None
        value = next((a.t for a in node.attribute if a.name == "value"), None)
        if value is None:  # no value: float zeros, no index
            return None
        found = numpy_helper.to_array(value)
        return found.astype(np.int64).ravel() if np.issubdtype(found.dtype, np.integer) else None

    def rows(self, node: onnx.NodeProto, shape: list[int | None] | None) -> list[Rows]:
        """Each output of ``node`` that holds rows of its input 0 (of ``shape``) along one axis: ``Gather`` of
        constant positions, ``Slice`` with constant bounds that cuts one axis (of a static size; a slice of a whole
        axis keeps every row: rows None), ``Split`` along an axis of a static size. Nothing for anything else; of a
        value whose shape is not followed (``shape`` None), only a slice of everything (``[:, 0:2**63-1]``)."""
        if node.op_type not in {"Gather", "Slice", "Split"} or (shape is None and node.op_type != "Slice"):
            return []
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        rank = len(shape) if shape is not None else 0

        def size(axis: int) -> int | None:
            return shape[axis % rank] if shape is not None and -rank <= axis < rank else None

        if node.op_type == "Gather":
            picked, axis = self.constant(node.input[1]), int(attrs.get("axis", 0))
            n = size(axis)
            if picked is None or not n or not np.all((-n <= picked) & (picked < n)):
                return []
            return [(axis % rank, np.unique(picked % n), node.output[0])]
        if node.op_type == "Split":
            axis = int(attrs.get("axis", 0))
            n = size(axis)
            given = self.constant(node.input[1]) if len(node.input) > 1 and node.input[1] else attrs.get("split")
            if not n:
                return []
            if given is None:  # equal pieces, the last one smaller (opset 18's num_outputs)
                chunk = -(-n // len(node.output))
                given = [max(0, min(chunk, n - i * chunk)) for i in range(len(node.output))]
            ends = np.cumsum(np.asarray(given, np.int64))
            if len(ends) != len(node.output) or ends[-1] != n:
                return []
            return [(axis % rank, np.arange(e - s, e), out) for s, e, out in zip(given, ends, node.output)]
        if len(node.input) > 1:  # Slice-10 and later: bounds as inputs
            bounds = [
                self.constant(node.input[i]) if len(node.input) > i and node.input[i] else None for i in range(1, 5)
            ]
        else:
            bounds = [attrs.get(k) for k in ("starts", "ends", "axes")] + [None]
        starts, ends, axes, steps = bounds
        if starts is None or ends is None:
            return []
        axes = range(len(starts)) if axes is None else axes
        steps = [1] * len(starts) if steps is None else steps
        cut: list[Rows] = []
        for start, end, axis, step in zip(starts, ends, axes, steps):
            n = size(int(axis))
            if step == 0:  # not a valid Slice: no rows known
                return []
            if not n:
                if start == 0 and end >= 2**31 - 1 and step == 1:  # the whole of an axis of unknown size
                    continue
                return []
            kept = np.arange(*slice(int(start), int(end), int(step)).indices(n))
            if len(kept) < n:
                cut.append((int(axis) % rank, kept, node.output[0]))
        if len(cut) > 1:  # a block of rows of two axes: not rows of one
            return []
        return cut or [(0, None, node.output[0])]

    def indexed(self, node: onnx.NodeProto) -> int | None:
        """The number of positions input 1 of ``node`` (an op of :data:`_INDEXES`) addresses, where the graph
        knows it: see :func:`index_ranges`."""
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "Gather":
            dims = self.table(node.input[0]) or self.shape(node.input[0])
            if not dims or len(dims) < 2:
                return None
        else:
            dims = self.shape(node.input[0])
        if not dims:
            return None
        if node.op_type in {"GatherND", "ScatterND"}:
            index = self.shape(node.input[1])
            first, k = int(attrs.get("batch_dims", 0)), index[-1] if index else None
            addressed = dims[first : first + k] if k else []
            return max(addressed) if k and len(addressed) == k and all(addressed) else None  # type: ignore[type-var]
        axis = int(attrs.get("axis", 0))
        return dims[axis] or None if -len(dims) <= axis < len(dims) else None

    def table(self, name: str) -> list[int] | None:
        """The dims of the initializer ``name`` is (cast, dequantized: an FP16 or INT8 embedding), or None."""
        node = self.producer.get(name)
        while node is not None and node.op_type in {"Cast", "DequantizeLinear", "Identity"}:
            name, node = node.input[0], self.producer.get(node.input[0])
        return self.tables.get(name)

    def shape(self, name: str) -> list[int | None] | None:
        """The dims of value ``name`` (None where not a number), or None where its rank is unknown."""
        if name in self.tables:
            return self.tables[name]
        if name in self.declared:
            return self.declared[name]
        if self._inferred is None:
            self._inferred = _inferred_shapes(self.model)
        return self._inferred.get(name)

    def constant(self, name: str) -> np.ndarray | None:
        """The integer values of ``name`` where it is an initializer or a Constant node's output, or one reshaped or
        cast (torch.onnx.export(dynamo=True) writes a slice's bounds as ``Reshape(Cast(Constant))``), else None."""
        name, node = traced_back(name, self.producer, _keeps_integers)
        try:
            if node is not None and node.op_type == "Constant" and node.attribute:
                value = onnx.helper.get_attribute_value(node.attribute[0])
                found = numpy_helper.to_array(value) if isinstance(value, onnx.TensorProto) else np.asarray(value)
            else:
                init = next((i for i in self.model.graph.initializer if i.name == name), None)
                if init is None or init.data_location == onnx.TensorProto.EXTERNAL:
                    return None
                found = numpy_helper.to_array(init)
        except Exception:  # a Constant of strings or floats: no rows
            return None
        return found.astype(np.int64).ravel() if np.issubdtype(found.dtype, np.integer) else None


# the number of positions :class:`_FloorGraph` gives an axis the graph does not fix: past any size a call can have
_OPEN = 2**62


def index_floors(model: onnx.ModelProto) -> dict[str, int]:
    """Graph input -> the smallest value it may hold, for an input :func:`index_ranges` gives no range because an
    axis its values index has no size in the graph (a graph neural network's ``edge_index`` into a dynamic number of
    nodes: ``index_select``, ``index_add_``, ``torch.gather``): 0, or what a constant added on the way leaves
    (``ids - 1``: 1). The call's own data fixes the axis's end, but not its start: ONNX's index ops take a negative
    index as counted from the end, where PyTorch's refuse it, so an engine would answer an index PyTorch refuses."""
    fixed = _IndexGraph(model)
    ranged = fixed.ranges()
    graph = _FloorGraph(model)
    graph._inferred = fixed._inferred  # shape inference runs once
    floors: dict[str, int] = {}
    for name, bounds in graph.ranges().items():
        if name not in ranged:
            columns = by_column(bounds, len(bounds)) or [whole_range(bounds)]
            floors[name] = min(low for low, _ in columns)
    return floors


class _FloorGraph(_IndexGraph):
    """An :class:`_IndexGraph` that takes an indexed axis of no size in the graph as :data:`_OPEN` positions: the
    inputs that reach one get a range from their floor to past any call's axis (:func:`index_floors`)."""

    def indexed(self, node: onnx.NodeProto) -> int | None:
        found = super().indexed(node)
        return found if found is not None or not self.open_axis(node) else _OPEN

    def open_axis(self, node: onnx.NodeProto) -> bool:
        """Whether input 1 of ``node`` (an op of :data:`_INDEXES`) indexes an axis of input 0 that has no size in
        the graph (a Gather of a table of two or more dimensions, as :meth:`_IndexGraph.indexed` reads)."""
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        table = self.table(node.input[0]) if node.op_type == "Gather" else None
        dims = table or self.shape(node.input[0])
        if not dims or (node.op_type == "Gather" and len(dims) < 2):
            return False
        if node.op_type in {"GatherND", "ScatterND"}:
            index = self.shape(node.input[1])
            first, k = int(attrs.get("batch_dims", 0)), index[-1] if index else None
            addressed = dims[first : first + k] if k else []
            return bool(k) and len(addressed) == k and not all(addressed)
        axis = int(attrs.get("axis", 0))
        return -len(dims) <= axis < len(dims) and not dims[axis]


def _keeps_integers(node: onnx.NodeProto) -> bool:
    """Whether ``node``'s output holds the integers of its first input: a reshape, or a Cast to int64 (a narrower
    one would wrap them)."""
    return node.op_type in {"Identity", "Reshape", "Squeeze", "Unsqueeze", "Flatten"} or (
        node.op_type == "Cast" and cast_to(node) == onnx.TensorProto.INT64
    )


def _start_axis(axes: Axes, axis: int) -> int:
    """The graph input's axis that ``axis`` of a value followed from it is (:data:`Axes`)."""
    return axis if axes is None or axes[axis] is None else axes[axis]  # type: ignore[return-value]


def cast_to(node: onnx.NodeProto) -> int:
    """The type a Cast node casts to."""
    return next((a.i for a in node.attribute if a.name == "to"), 0)


def traced_back(
    name: str, producer: dict[str, onnx.NodeProto], through: Callable[[onnx.NodeProto], bool]
) -> tuple[str, onnx.NodeProto | None]:
    """The value ``name`` comes from through the nodes ``through`` accepts (each read along its first input: a
    Reshape, a Cast), and the node that makes it (None: a graph input or an initializer)."""
    node = producer.get(name)
    while node is not None and node.input and through(node):
        name, node = node.input[0], producer.get(node.input[0])
    return name, node


def _dims(value: onnx.ValueInfoProto) -> list[int | None] | None:
    """A value's declared dims (None where not a number), or None where it declares no shape."""
    tensor = value.type.tensor_type
    if not tensor.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]


def _inferred_shapes(model: onnx.ModelProto) -> dict[str, list[int | None] | None]:
    """Every value's dims as ONNX shape inference finds them on a copy of ``model`` without its weights (data
    propagated: ``zeros_like(h)`` is ``Expand(0, Shape(h))``); the shapes the model records where inference fails."""
    light, _ = light_model(model, keep_value_info=False)
    try:
        graph = onnx.shape_inference.infer_shapes(light, data_prop=True).graph
    except Exception as exc:
        log.debug("shape inference for index ranges failed: %s", first_line(exc))
        graph = model.graph
    return {v.name: _dims(v) for v in (*graph.value_info, *graph.output)}


# The fix for data whose indices run past a table the graph stores
INDEX_HINT = (
    "give indices within what the input indexes (token ids past a vocabulary: data or a tokenizer made for another "
    "model's; node indices past a graph's nodes), "
    "or a model made for this data"
)


def outside_index(
    model: onnx.ModelProto, feed: dict[str, np.ndarray], name: str, counted_from_end: bool = True
) -> str | None:
    """Why ``feed`` holds an index past a table ``model`` stores (:func:`index_ranges`; ``name``: the model's, for
    the sentence), or None. ONNX Runtime stops at the first such index with a traceback from deep in the graph;
    checked before the data reaches it, the error names the input, the value and the table's rows.

    ``counted_from_end``: the data may count from the end of a table down to ``-rows``, as ``Gather`` does; only
    where the engines made with the data take its lows too (a run's engines record ranges from the data's smallest
    value: `kiln run`'s check of a taken graph). False checks the ranges an engine built without the data records,
    0 to rows - 1 (`kiln build` of a variant of `kiln precision --calibration`), in the words its own check uses."""
    ranges = index_ranges(model)
    found = first_outside({k: from_end(r) for k, r in ranges.items()} if counted_from_end else ranges, feed)
    if found is None:
        return None
    key, value, _, cell = found
    bounds = (
        ranges[key] if cell is None else ranges[key][int(np.ravel_multi_index(cell, feed[key].shape[-len(cell) :]))]
    )
    low, high = whole_range(bounds)  # type: ignore[arg-type]
    where = cell_text(key, cell)
    if not counted_from_end:
        return (
            f"input '{key}' holds {value}{where}: {name} takes values from {low} to {high} {'there ' if where else ''}"
            "(the positions of the axis it indexes: a table's rows, a graph's nodes)"
        )
    return (
        f"input '{key}' holds {value}{where}: {name} indexes an axis of {high - low + 1} positions "
        f"with it (values {low} to {high}, or down to {2 * low - high - 1} counted from its end)"
    )


def from_end(bounds: IntRange) -> IntRange:
    """An index range (:func:`index_ranges`) with the negative indices ONNX's index ops take added: ``[0, n - 1]``
    becomes ``[-n, n - 1]`` (``[low, high]``, an index shifted by ``-low``: ``[low - n, high]``), column by column
    (or cell by cell) where it has one per column (or cell)."""
    columns = by_column(bounds, len(bounds))
    if columns is not None:
        return [_from_end(c) for c in columns]
    return _from_end(whole_range(bounds))


def _from_end(bounds: list[int]) -> list[int]:
    low, high = bounds
    return [2 * low - high - 1, high]


QDQ = {"QuantizeLinear", "DequantizeLinear"}


def graph_carries_precision(onnx_path: Path) -> bool:
    """True when the graph already has FP16/BF16/FP8 tensors or Q/DQ nodes (precision lives in the graph)."""
    return model_carries_precision(onnx.load(str(onnx_path), load_external_data=False))


def model_carries_precision(model: onnx.ModelProto) -> bool:
    """:func:`graph_carries_precision` of a model already in memory."""
    low = {onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT8E4M3FN}
    if any(n.op_type in QDQ for n in model.graph.node):
        return True
    if any(i.data_type in low for i in model.graph.initializer):
        return True
    return any(v.type.tensor_type.elem_type in low for v in model.graph.value_info)


def fixed_batch(model: onnx.ModelProto) -> tuple[int, str] | None:
    """The batch size a graph fixes (every real input's first axis the same number) and one input as written
    (``image [1, 3, 224, 224]``); None where the batch axis is symbolic, or the inputs disagree."""
    weights = {t.name for t in model.graph.initializer}
    dims = [(v, list(v.type.tensor_type.shape.dim)) for v in model.graph.input if v.name not in weights]
    first = [d[0].dim_value if d and d[0].HasField("dim_value") else 0 for _, d in dims]
    if not first or first[0] < 1 or any(b != first[0] for b in first):
        return None
    value, shape = dims[0]
    written = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in shape]
    return first[0], f"{value.name} {written}"


def free_batch(model: onnx.ModelProto, batch: int) -> onnx.ModelProto:
    """``model`` (changed in place, and returned) with the first axis of its inputs, and of each output whose first
    axis is ``batch``, the symbol ``batch``; the shapes inside are inferred again. Whether the graph computes the
    same rows at another batch is the caller's to check (a Reshape to a fixed ``[1, -1]`` does not)."""
    weights = {t.name for t in model.graph.initializer}
    ends = [v for v in model.graph.input if v.name not in weights] + list(model.graph.output)
    for value in ends:
        dims = value.type.tensor_type.shape.dim
        if dims and dims[0].HasField("dim_value") and dims[0].dim_value == batch:
            dims[0].dim_param = "batch"  # a oneof with dim_value: setting one clears the other
    return infer_shapes(model, strict=False)
