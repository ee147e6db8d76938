"""Shape arithmetic over static dimensions: Shape(start/end), and Shape -> Gather / Slice, that read only axes
whose size shape inference proved become constants.

onnx-graphsurgeon folds a Shape only when its input's whole shape is static, and ignores Shape's start/end
attributes; exporters (the dynamo exporter's LSTM, HF attention) read one static axis of a batch-dynamic
tensor all the time, and each such read keeps a whole shape subgraph alive. Written by hand for that reason.
"""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel

from kiln.core.lazy import lazy_import
from kiln.stages.optimize.passes.util import const, known_shape
from kiln.stages.optimize.registry import register

gs = lazy_import("onnx_graphsurgeon")  # loaded when a pass first runs, not when the config is read


def _clamp(i: int, rank: int) -> int:
    """Shape/Slice index rules: negative counts from the end, then clamped to [0, rank]."""
    return min(max(i + rank if i < 0 else i, 0), rank)


def shape_dims(node: gs.Node) -> list[int | str | None] | None:
    """The dims a Shape node outputs (ints where static, else the symbol or None), or None if unknown."""
    shape = known_shape(node.inputs[0])
    if shape is None:
        return None
    rank = len(shape)
    start = _clamp(int(node.attrs.get("start", 0)), rank)
    end = _clamp(int(node.attrs.get("end", rank)), rank)
    return shape[start:end]


def _static(dims: list) -> bool:
    return all(isinstance(d, (int, np.integer)) and d >= 0 for d in dims)


def _picked(reader: gs.Node, dims: list) -> np.ndarray | None:
    """What a Gather/Slice over the shape vector ``dims`` outputs, when every element it picks is static."""
    n = len(dims)
    if reader.op == "Gather" and int(reader.attrs.get("axis", 0)) == 0:
        idx = const(reader.inputs[1])
        if idx is None or not np.issubdtype(idx.dtype, np.integer) or np.any((idx < -n) | (idx >= n)):
            return None
        picked = [dims[int(i)] for i in idx.ravel()]
        return np.array(picked, dtype=np.int64).reshape(idx.shape) if _static(picked) else None
    if reader.op == "Slice":
        args: list[np.ndarray | None] = []
        for i in range(1, 5):  # starts, ends, axes, steps; absent optional inputs are None
            t = reader.inputs[i] if i < len(reader.inputs) else None
            v = const(t) if t is not None and t.name else None
            if t is not None and t.name and v is None:
                return None  # computed at run time
            args.append(v)
        starts, ends, axes, steps = args
        if starts is None or ends is None or starts.size != 1 or ends.size != 1:
            return None
        if (axes is not None and int(axes.ravel()[0]) not in (0, -1)) or (steps is not None and steps.size != 1):
            return None
        step = int(steps.ravel()[0]) if steps is not None else 1
        # Python slices clamp out-of-range bounds the way ONNX Slice does (INT64_MAX ends included).
        picked = dims[slice(int(starts.ravel()[0]), int(ends.ravel()[0]), step)] if step else None
        return np.array(picked, dtype=np.int64) if picked is not None and _static(picked) else None
    return None


def _make_const(graph: gs.Graph, t: gs.Variable, value: np.ndarray) -> bool:
    if t in graph.outputs:  # a graph output keeps its producer (an output that is an initializer confuses runtimes)
        return False
    t.to_constant(value)
    t.inputs.clear()
    return True


@register("fold_shapes")
def fold_shapes(graph: gs.Graph, p: BaseModel) -> int:
    """Shape (with start/end) over static axes, and Gather/Slice of a Shape that pick only static axes -> constants."""
    n = 0
    for node in list(graph.nodes):
        if node.op != "Shape" or not node.outputs or not node.inputs:
            continue
        dims = shape_dims(node)
        if dims is None:
            continue
        out = node.outputs[0]
        if _static(dims):
            n += _make_const(graph, out, np.array(dims, dtype=np.int64))
            continue
        for reader in list(out.outputs):
            value = _picked(reader, dims) if reader.outputs else None
            if value is not None:
                n += _make_const(graph, reader.outputs[0], value)
    return n


def shape_value(t: gs.Tensor, depth: int = 6) -> list[int | str] | None:
    """The value of a 1-D shape tensor built from constants and Shape reads (Concat, Gather, Unsqueeze/Squeeze
    of a Shape), entry by entry: ints, or the symbol of a dynamic axis. None when any entry is unknown."""
    c = const(t)
    if c is not None:
        return [int(v) for v in c.ravel()] if c.ndim <= 1 and np.issubdtype(c.dtype, np.integer) else None
    node = t.inputs[0] if len(t.inputs) == 1 and depth else None
    if node is None:
        return None
    if node.op == "Shape":
        dims = shape_dims(node)
        return dims if dims is not None and all(isinstance(d, (int, str)) and d != "" for d in dims) else None
    if node.op == "Concat" and int(node.attrs.get("axis", 0)) in (0, -1):
        parts = [shape_value(i, depth - 1) for i in node.inputs]
        return None if any(p is None for p in parts) else [d for p in parts for d in p]
    if node.op in ("Unsqueeze", "Squeeze", "Identity", "Cast"):
        return shape_value(node.inputs[0], depth - 1)
    if node.op == "Gather" and int(node.attrs.get("axis", 0)) == 0:
        src, idx = shape_value(node.inputs[0], depth - 1), const(node.inputs[1])
        if src is None or idx is None or np.any((idx < -len(src)) | (idx >= len(src))):
            return None
        return [src[int(i)] for i in idx.ravel()]
    return None


def static_reshape_target(node: gs.Node) -> np.ndarray | None:
    """A constant target for a Reshape whose computed shape spells out static sizes plus the input's own dynamic
    axes at the same positions (-> 0, "copy"), with at most one other unknown (-> -1). Exact by construction."""
    want, src = shape_value(node.inputs[1]), known_shape(node.inputs[0])
    if want is None or src is None:
        return None
    allowzero = int(node.attrs.get("allowzero", 0))
    out, infer = [], 0
    for i, d in enumerate(want):
        if isinstance(d, int):
            if d == 0 and allowzero:
                return None  # a literal zero-sized axis: the result's 0 would mean "copy" instead
            infer += d == -1
            out.append(d)
        elif i < len(src) and src[i] == d:
            out.append(0)
        else:
            infer += 1
            out.append(-1)
    return np.array(out, dtype=np.int64) if infer <= 1 else None
