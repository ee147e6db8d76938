"""Elimination: nodes that compute nothing (Identity, Dropout, no-op Cast/Reshape/Transpose/Expand/Slice),
redundant Cast chains, duplicate subgraphs (CSE) and unused initializers."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable

import numpy as np
from pydantic import BaseModel

from kiln.core.lazy import lazy_import
from kiln.stages.optimize.passes.util import (
    RANDOM_OPS,
    const,
    drop,
    known_shape,
    producer,
    replace_uses,
)
from kiln.stages.optimize.registry import register

onnx = lazy_import("onnx")
gs = lazy_import("onnx_graphsurgeon")  # loaded when a pass first runs, not when the config is read


def _bypass(graph: gs.Graph, node: gs.Node, keep: gs.Tensor) -> int:
    """Readers of ``node``'s output read ``keep`` instead; the node is dropped. 1 if it happened."""
    if replace_uses(graph, node.outputs[0], keep, via=node):
        drop(node)
        return 1
    return 0


@register("eliminate_identity")
def eliminate_identity(graph: gs.Graph, p: BaseModel) -> int:
    """Remove Identity nodes and inference-mode Dropout (whose mask output nobody reads)."""
    n = 0
    for node in list(graph.nodes):
        if not node.outputs or not node.inputs:
            continue  # nothing to bypass (a malformed node is left for the checker to report)
        if node.op == "Identity":
            n += _bypass(graph, node, node.inputs[0])
        elif node.op == "Dropout":
            training = const(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2].name else np.array(False)
            mask_used = len(node.outputs) > 1 and (node.outputs[1].outputs or node.outputs[1] in graph.outputs)
            if training is not None and not bool(training) and not mask_used:
                n += _bypass(graph, node, node.inputs[0])
    return n


# dtype -> dtypes that hold every one of its values exactly (so a round trip through them is lossless)
_WIDER: dict[str, set[str]] = {
    "float16": {"float32", "float64"},
    "float32": {"float64"},
    "bool": {"int8", "int16", "int32", "int64", "uint8", "float16", "float32", "float64"},
    "int8": {"int16", "int32", "int64", "float32", "float64"},
    "uint8": {"int16", "int32", "int64", "float32", "float64", "uint16", "uint32", "uint64"},
    "int16": {"int32", "int64", "float32", "float64"},
    "int32": {"int64", "float64"},
}


def _dtype_name(t: gs.Tensor) -> str | None:
    try:
        return np.dtype(t.dtype).name if t.dtype is not None else None
    except TypeError:
        return None


def _cast_target(node: gs.Node) -> str | None:
    try:
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(node.attrs["to"])).name
    except (KeyError, TypeError, ValueError):
        return None


def _same_shape(a: gs.Tensor, b: gs.Tensor) -> bool:
    sa, sb = known_shape(a), known_shape(b)
    return (
        sa is not None
        and sb is not None
        and len(sa) == len(sb)
        and all(x == y and (isinstance(x, int) or (isinstance(x, str) and x)) for x, y in zip(sa, sb))
    )


def _opt_const(node: gs.Node, i: int) -> tuple[bool, np.ndarray | None]:
    """(known, value) of optional input ``i``: absent inputs are known (None), variable ones are not."""
    if i >= len(node.inputs) or not node.inputs[i].name:
        return True, None
    v = const(node.inputs[i])
    return v is not None, v


def _noop_slice(node: gs.Node) -> bool:
    known = [_opt_const(node, i) for i in range(1, 5)]
    if not all(k for k, _ in known) or known[0][1] is None or known[1][1] is None:
        return False
    starts, ends, axes, steps = (v for _, v in known)
    axes = axes if axes is not None else np.arange(len(starts))
    steps = steps if steps is not None else np.ones(len(starts), dtype=np.int64)
    shape = known_shape(node.inputs[0])
    for s, e, a, st in zip(starts.ravel(), ends.ravel(), axes.ravel(), steps.ravel()):
        dim = shape[int(a)] if shape is not None and -len(shape) <= int(a) < len(shape) else None
        full_end = e >= 2**62 or (isinstance(dim, int) and e >= dim)
        if s != 0 or st != 1 or not full_end:
            return False
    return True


def _reshape_keeps_shape(node: gs.Node) -> bool:
    """Constant target shape that spells out the input's own shape (static axes equal, one -1 or 0 for the
    single dynamic axis)."""
    shape, src = const(node.inputs[1]), known_shape(node.inputs[0])
    if shape is None or src is None or shape.size != len(src):
        return False
    allowzero = node.attrs.get("allowzero", 0)
    dynamic = [i for i, d in enumerate(src) if not isinstance(d, int)]
    for i, (want, have) in enumerate(zip(shape.tolist(), src)):
        copies = want == 0 and not allowzero
        if not (copies or want == have or (want == -1 and len(dynamic) <= 1 and (i in dynamic or not dynamic))):
            return False
    return True


def _is_noop(node: gs.Node) -> bool:
    if node.op == "Cast":
        return _dtype_name(node.inputs[0]) is not None and _dtype_name(node.inputs[0]) == _cast_target(node)
    if node.op == "Transpose":
        perm = node.attrs.get("perm")
        return perm is not None and list(perm) == list(range(len(perm)))
    if node.op == "Reshape" and _reshape_keeps_shape(node):
        return True
    if node.op in ("Reshape", "Expand", "Squeeze", "Unsqueeze", "Flatten"):
        return _same_shape(node.inputs[0], node.outputs[0])
    if node.op == "Slice":
        return _noop_slice(node)
    if node.op == "Pad":  # any mode: with no padding the output is the input
        pads = const(node.inputs[1]) if len(node.inputs) > 1 else np.asarray(node.attrs.get("pads", [1]))
        return pads is not None and pads.size > 0 and not pads.any()
    if node.op == "Tile":
        repeats = const(node.inputs[1])
        return repeats is not None and bool((repeats == 1).all())
    return False


@register("eliminate_noop")
def eliminate_noop(graph: gs.Graph, p: BaseModel) -> int:
    """Remove Cast/Reshape/Transpose/Expand/Slice/Pad/Tile that return their input unchanged; shorten lossless Cast
    chains."""
    n = 0
    for node in list(graph.nodes):
        if not node.outputs or not node.inputs:
            continue
        if _is_noop(node):
            n += _bypass(graph, node, node.inputs[0])
            continue
        first = producer(node.inputs[0], "Cast") if node.op == "Cast" else None
        if first is None:
            continue
        src, mid = _dtype_name(first.inputs[0]), _cast_target(first)
        if src is None or mid not in _WIDER.get(src, set()):
            continue  # the first cast may round: both casts are needed
        if src == _cast_target(node):
            n += _bypass(graph, node, first.inputs[0])  # x -> wider -> back: nothing happened
        else:
            node.inputs[0] = first.inputs[0]  # x -> wider -> other == x -> other
            n += 1
    return n


def _const_key(t: gs.Constant) -> tuple:
    v = np.asarray(t.values)
    return (v.dtype.str, v.shape, hashlib.sha1(np.ascontiguousarray(v).tobytes()).hexdigest())


def _attr_key(v: object) -> object:
    """Attribute values by content: a tensor attribute's repr shows only its name, shape and dtype (so
    ConstantOfShape(value=0) and ConstantOfShape(value=1) once looked identical)."""
    if isinstance(v, gs.Constant):
        return _const_key(v)
    if isinstance(v, np.ndarray):
        return _const_key(gs.Constant("", v))
    if isinstance(v, (list, tuple)):
        return tuple(_attr_key(x) for x in v)
    return repr(v)


def _node_key(node: gs.Node) -> tuple | None:
    if node.op in ("Constant",) or any(isinstance(v, gs.Graph) for v in node.attrs.values()):
        return None  # Constants are deduplicated as tensors; subgraph attributes are not compared
    if node.op in RANDOM_OPS:
        return None  # each call draws new numbers: two of them are not duplicates
    attrs = tuple(sorted((k, _attr_key(v)) for k, v in node.attrs.items()))
    return (node.op, node.domain, tuple(id(t) for t in node.inputs), attrs, len(node.outputs))


def _sample_key(t: gs.Constant) -> bytes:
    """The first and last bytes of a constant's data, read from the ONNX tensor under graphsurgeon's lazy view
    without loading it where the tensor holds raw bytes: weights of one shape (a transformer's layers) differ
    there. Other constants are loaded (the little-endian bytes of their values, as raw data holds them)."""
    lazy = t._values
    raw = b""
    if type(lazy) is gs.ir.tensor.LazyValues and lazy.tensor.data_location != onnx.TensorProto.EXTERNAL:
        raw = lazy.tensor.raw_data
    if not raw:
        raw = np.ascontiguousarray(t.values).tobytes()
    return raw[:64] + raw[-64:] if len(raw) > 128 else raw


def _duplicate_constants(graph: gs.Graph) -> dict[int, gs.Constant]:
    """id of each constant input that repeats an earlier one -> that earlier one. Only constants that share a
    dtype, a shape and their first and last bytes are read and hashed: reading one turns graphsurgeon's lazy view
    of the ONNX tensor into a copy that the exporter converts back, and a model's big weights are distinct."""
    groups: dict[tuple, dict[int, gs.Constant]] = {}
    for node in graph.nodes:
        for t in node.inputs:
            if isinstance(t, gs.Constant):
                groups.setdefault((str(t.dtype), tuple(t.shape)), {})[id(t)] = t
    same: dict[int, gs.Constant] = {}
    for members in _split(groups.values(), _sample_key):
        first: dict[tuple, gs.Constant] = {}
        for t in members:
            keep = first.setdefault(_const_key(t), t)
            if keep is not t:
                same[id(t)] = keep
    return same


def _split(groups: Iterable[dict[int, gs.Constant]], key: Callable[[gs.Constant], bytes]) -> list[list[gs.Constant]]:
    """The groups of two or more, each split by ``key``, keeping the parts of two or more."""
    parts: list[list[gs.Constant]] = []
    for members in groups:
        if len(members) < 2:
            continue
        by_key: dict[bytes, list[gs.Constant]] = {}
        for t in members.values():
            by_key.setdefault(key(t), []).append(t)
        parts += [p for p in by_key.values() if len(p) > 1]
    return parts


@register("cse")
def cse(graph: gs.Graph, p: BaseModel) -> int:
    """Merge identical constants and nodes that compute the same op on the same inputs (common subexpressions)."""
    n = 0
    same = _duplicate_constants(graph)
    for node in graph.nodes:  # identical constants first, so duplicate nodes over them become identical too
        for i, t in enumerate(node.inputs):
            keep = same.get(id(t))
            if keep is not None:
                node.inputs[i] = keep
                n += 1
    changed = True
    while changed:
        changed = False
        graph.toposort()
        seen: dict[tuple, gs.Node] = {}
        for node in list(graph.nodes):
            key = _node_key(node)
            if key is None or not node.outputs:
                continue
            keep = seen.setdefault(key, node)
            if keep is node:
                continue
            if any(o in graph.outputs for o in node.outputs):
                continue  # a graph output keeps its own producer (its name is part of the model's interface)
            for o, k in zip(node.outputs, keep.outputs):
                replace_uses(graph, o, k)
            drop(node)
            n += 1
            changed = True
    return n


@register("remove_unused_initializers")
def remove_unused_initializers(graph: gs.Graph, p: BaseModel) -> int:
    """Drop initializers (and any nodes) that no graph output depends on."""
    before = sum(1 for t in graph.tensors().values() if isinstance(t, gs.Constant))
    graph.cleanup(remove_unused_graph_inputs=False)
    return before - sum(1 for t in graph.tensors().values() if isinstance(t, gs.Constant))


# op -> (neutral element, whether it may stand on the left): x+0, 0+x, x-0, x*1, 1*x, x/1
_NEUTRAL: dict[str, tuple[int, bool]] = {"Add": (0, True), "Sub": (0, False), "Mul": (1, True), "Div": (1, False)}


def _broadcast_keeps(x: gs.Tensor, c: np.ndarray) -> bool:
    """Broadcasting ``c`` against ``x`` leaves x's shape as it is (c has no more axes, each 1 or x's static size)."""
    shape = known_shape(x)
    if shape is None or c.ndim > len(shape):
        return False
    return all(cd == 1 or (isinstance(xd, int) and xd == cd) for cd, xd in zip(c.shape[::-1], shape[::-1]))


def _neutral_input(node: gs.Node) -> gs.Tensor | None:
    """The variable input of ``node`` when its other input is the op's neutral element (else None)."""
    if node.op not in _NEUTRAL or len(node.inputs) != 2 or len(node.outputs) != 1:
        return None
    unit, commutes = _NEUTRAL[node.op]
    for x, c_t, ok in ((node.inputs[0], node.inputs[1], True), (node.inputs[1], node.inputs[0], commutes)):
        c = const(c_t)
        if (
            ok
            and c is not None
            and const(x) is None
            and c.size
            and np.all(c == unit)
            and _dtype_name(x) is not None
            and _dtype_name(x) == np.dtype(c.dtype).name
            and _broadcast_keeps(x, c)
        ):
            return x
    return None


@register("eliminate_neutral")
def eliminate_neutral(graph: gs.Graph, p: BaseModel) -> int:
    """Remove Add/Sub of zeros and Mul/Div by ones (e.g. zero biases) whose broadcast leaves the other input's shape."""
    n = 0
    for node in list(graph.nodes):
        x = _neutral_input(node)
        if x is not None:
            n += _bypass(graph, node, x)
    return n


_ZERO_PRESERVING = ("Expand", "Slice", "Reshape", "Tile", "Squeeze", "Unsqueeze", "Identity", "Transpose", "Flatten")
_RNN_STATES = {"RNN": (5,), "GRU": (5,), "LSTM": (5, 6)}  # input slots of initial_h (and initial_c)


def _is_zeros(t: gs.Tensor, depth: int = 8) -> bool:
    """``t`` holds only zeros: a zero constant, ConstantOfShape(0), or one moved/sliced/broadcast from those."""
    c = const(t)
    if c is not None:
        return c.size > 0 and not np.any(c)
    node = producer(t) if depth else None
    if node is None:
        return False
    if node.op == "ConstantOfShape":
        value = node.attrs.get("value")
        return value is None or not np.any(np.asarray(value.values if isinstance(value, gs.Constant) else value))
    return node.op in _ZERO_PRESERVING and bool(node.inputs) and _is_zeros(node.inputs[0], depth - 1)


@register("eliminate_zero_rnn_state")
def eliminate_zero_rnn_state(graph: gs.Graph, p: BaseModel) -> int:
    """Drop RNN/GRU/LSTM initial_h/initial_c inputs that are all zeros (the spec's default when absent)."""
    n = 0
    for node in graph.nodes:
        for slot in _RNN_STATES.get(node.op, ()):
            if slot < len(node.inputs) and node.inputs[slot].name and _is_zeros(node.inputs[slot]):
                node.inputs[slot] = gs.Variable.empty()
                n += 1
        while n and node.op in _RNN_STATES and node.inputs and not node.inputs[-1].name:
            node.inputs.pop()  # trailing absent optional inputs are simply left out
    return n
