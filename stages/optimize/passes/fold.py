"""Constant folding to a fixpoint (shape subgraphs included), cleanup and topological sort."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from kiln.core.lazy import lazy_import
from kiln.stages.optimize.passes.shapes import fold_shapes, static_reshape_target
from kiln.stages.optimize.passes.util import RANDOM_OPS, const, known_shape, new_const, unique_name
from kiln.stages.optimize.registry import register

onnx = lazy_import("onnx")
gs = lazy_import("onnx_graphsurgeon")  # loaded when a pass first runs, not when the config is read


log = logging.getLogger("kiln.optimize")


class FoldParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_rounds: int = Field(8, ge=1, description="fold/clean rounds before giving up on a fixpoint")
    size_threshold: int | None = Field(
        64 << 20,
        description="bytes: do not fold tensors larger than this (keeps e.g. huge Expand results out of the file)",
    )
    static_reshape: bool = Field(
        True, description="replace computed Reshape shapes by constants when at most one axis (the batch) is dynamic"
    )
    static_shapes: bool = Field(
        True,
        description="fold Shape(start/end) and Shape -> Gather/Slice reads of static "
        "axes (the fold_shapes pass) in every round",
    )
    library: bool = Field(
        True,
        description="also run onnx-graphsurgeon's constant folding (constant subgraphs evaluated in ONNX Runtime, "
        "shape-tensor casts elided); off, Kiln's own steps alone (CastLike, static reshapes and shapes, transposed "
        "weights)",
    )

    def fallback(self) -> tuple[FoldParams, str] | None:
        """The pass without onnx-graphsurgeon's folding, for the safety net to try where the whole pass changed the
        outputs: that part is a library's, and Kiln's own steps need not go down with it."""
        return (self.model_copy(update={"library": False}), "onnx-graphsurgeon's folding") if self.library else None


@contextmanager
def _quiet_gs() -> Iterator[None]:
    # graphsurgeon logs every op it cannot fold at WARNING; those are expected (dynamic inputs), not news.
    logger = gs.logger.G_LOGGER
    old = logger.severity
    logger.severity = logger.ERROR
    try:
        yield
    finally:
        logger.severity = old


def _np_to_onnx_dtype(dtype: object) -> int | None:
    try:
        return int(onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype)))
    except (TypeError, KeyError, ValueError):
        return None


def resolve_castlike(graph: gs.Graph) -> int:
    """CastLike whose ``target_type`` input has a known dtype -> plain Cast (which folds if its input is constant)."""
    n = 0
    for node in graph.nodes:
        if node.op != "CastLike" or len(node.inputs) != 2 or node.inputs[1].dtype is None:
            continue
        to = _np_to_onnx_dtype(node.inputs[1].dtype)
        if to is None:
            continue
        node.op, node.inputs, node.attrs = "Cast", [node.inputs[0]], {"to": to}
        n += 1
    return n


def fold_transposes(graph: gs.Graph, size_threshold: int | None) -> int:
    """Transpose of a constant (a weight the exporter laid out for MatMul) -> the transposed constant, in numpy.
    graphsurgeon's folder computes the same in ONNX Runtime, for which it serializes every weight it touches."""
    outputs = set(map(id, graph.outputs))
    n = 0
    for node in graph.nodes:
        if node.op != "Transpose" or len(node.outputs) != 1 or id(node.outputs[0]) in outputs:
            continue
        values = const(node.inputs[0])
        if values is None or (size_threshold is not None and values.nbytes > size_threshold):
            continue
        out = node.outputs[0]
        node.outputs.clear()  # the node is dead now; cleanup drops it
        out.to_constant(np.ascontiguousarray(np.transpose(values, node.attrs.get("perm"))))
        n += 1
    return n


def static_reshapes(graph: gs.Graph) -> int:
    """Reshape whose shape is computed (e.g. from Shape(input)) but whose output shape is known except one
    axis -> constant shape, using 0 ("copy this axis") or -1 for that axis. Exact: shape inference already
    proved the output shape; this is what turns batch-only-dynamic shape subgraphs into dead code."""
    n = 0
    for node in graph.nodes:
        if node.op != "Reshape" or const(node.inputs[1]) is not None:
            continue
        out, src = known_shape(node.outputs[0]), known_shape(node.inputs[0])
        if out is None or sum(not isinstance(d, int) or d < 0 for d in out) > 1:
            target = static_reshape_target(node)  # the shape's own entries may still say it (HF attention)
            if target is not None:
                node.inputs[1] = new_const(graph, node.outputs[0].name + "_shape", target)
                copy_zeros(node)
                n += 1
            continue
        dyn = [i for i, d in enumerate(out) if not isinstance(d, int) or d < 0]
        if len(dyn) > 1 or any(d == 0 for d in out if isinstance(d, int)):
            continue  # two unknown axes cannot both be -1; a literal 0 would clash with copy semantics
        shape = [int(d) if i not in dyn else -1 for i, d in enumerate(out)]
        for i in dyn:  # prefer "copy from input" when the axis is the same symbol at the same position
            if src is not None and i < len(src) and isinstance(out[i], str) and src[i] == out[i]:
                shape[i] = 0
        node.inputs[1] = new_const(graph, node.outputs[0].name + "_shape", np.array(shape, dtype=np.int64))
        copy_zeros(node)
        n += 1
    return n


def copy_zeros(reshape: gs.Node) -> None:
    """A Reshape whose 0 entries copy the input's axis: ``allowzero`` dropped, whose default (0) says so in every
    opset; set to 0 it would be an attribute opsets below 14 do not have."""
    reshape.attrs.pop("allowzero", None)


# onnx-graphsurgeon's shape-tensor cast elision (fold_constants with fold_shapes=True): op(Cast(int -> float), ...)
# -> Cast(float -> int) becomes op(int, ...) with its constant inputs cast to int.
_ELISION_OPS = frozenset({"Add", "Sub", "Mul", "Div", "Max", "Min", "Equal", "Greater", "Less", "Concat"})
_COMPARISONS = frozenset({"Equal", "Greater", "Less"})


def _float_cast(t: gs.Tensor) -> bool:
    """``t`` is written by a Cast to float32 (the elision takes such an input back to its source type)."""
    return len(t.inputs) == 1 and t.inputs[0].op == "Cast" and t.inputs[0].attrs.get("to") == onnx.TensorProto.FLOAT


def _integral(t: gs.Tensor) -> bool:
    """``t`` is a constant the elision can cast to an integer type without changing a value."""
    v = const(t)
    if v is None:
        return False
    return np.issubdtype(v.dtype, np.integer) or bool(np.all(np.isfinite(v)) and np.all(v == np.trunc(v)))


def _wrong_elision(graph: gs.Graph, node: gs.Node) -> bool:
    """Whether the cast elision would match ``node`` and break it: an input that is neither a Cast from an integer
    nor an integral constant (a float variable, MPNet's relative-position buckets: the int inputs would meet a
    float one, which ONNX Runtime refuses; 0.5 would become 0), a reader casting to a non-integer type (it would
    read a tensor nobody writes), or a comparison (its bool output would be declared the integer type)."""
    if node.op not in _ELISION_OPS or not any(_float_cast(t) for t in node.inputs):
        return False
    readers = [r for t in node.outputs for r in t.outputs]
    if not readers or any(r.op != "Cast" for r in readers) or any(t in graph.outputs for t in node.outputs):
        return False  # the elision leaves it alone
    ints = (onnx.TensorProto.INT32, onnx.TensorProto.INT64)
    return (
        node.op in _COMPARISONS
        or any(r.attrs.get("to") not in ints for r in readers)
        or not all(_float_cast(t) or _integral(t) for t in node.inputs)
    )


def shield_casts(graph: gs.Graph) -> list[gs.Node]:
    """An Identity after every node the cast elision would break (:func:`_wrong_elision`), subgraphs included: the
    elision needs every reader to be a Cast, so it passes them by while it still elides the casts it gets right.
    Returns the Identities for :func:`unshield_casts`."""
    held = []
    for g in [graph, *graph.subgraphs(recursive=True)]:
        for node in [n for n in g.nodes if _wrong_elision(g, n)]:
            for i, out in enumerate(list(node.outputs)):
                mid = gs.Variable(unique_name(g, out.name + "_held"), dtype=out.dtype, shape=out.shape)
                node.outputs[i] = mid
                held.append(gs.Node("Identity", inputs=[mid], outputs=[out]))
                g.nodes.insert(g.nodes.index(node) + 1, held[-1])  # graphsurgeon folds in node order
    return held


def unshield_casts(held: list[gs.Node]) -> None:
    """Undo :func:`shield_casts`: each node writes its own output again. An Identity folded into a constant is
    left to ``cleanup``; one after a folded input stays for ``eliminate_identity``."""
    for ident in held:
        if not ident.outputs or not ident.inputs or not ident.inputs[0].inputs:
            continue
        mid, out = ident.inputs[0], ident.outputs[0]
        writer = mid.inputs[0]
        ident.outputs.clear()
        ident.inputs.clear()
        writer.outputs[writer.outputs.index(mid)] = out


def library_fold(graph: gs.Graph, size_threshold: int | None) -> None:
    """onnx-graphsurgeon's constant folding (shape reads and its cast elision included), minus the elisions that
    would break the graph (:func:`shield_casts`) and minus random ops: a random op has no variable inputs, so it
    looks foldable, and folding would freeze one draw forever."""
    held = shield_casts(graph)
    with _quiet_gs():
        graph.fold_constants(
            fold_shapes=True,
            size_threshold=size_threshold,
            error_ok=True,
            should_exclude_node=lambda node: node.op in RANDOM_OPS,
        )
    unshield_casts(held)


@register("fold_constants", FoldParams)
def fold_constants(graph: gs.Graph, p: FoldParams) -> int:
    """Fold everything computable ahead of time (CastLike, static shapes, constant subgraphs) until nothing changes."""
    total = 0
    for _ in range(p.max_rounds):
        before = len(graph.nodes)
        changed = (
            resolve_castlike(graph)
            + (static_reshapes(graph) if p.static_reshape else 0)
            + (fold_shapes(graph, p) if p.static_shapes else 0)
            + fold_transposes(graph, p.size_threshold)
        )
        if p.library:
            library_fold(graph, p.size_threshold)
        graph.cleanup()
        removed = before - len(graph.nodes)
        total += changed + max(removed, 0)
        if not changed and removed <= 0:
            break
    return total


@register("cleanup")
def cleanup(graph: gs.Graph, p: BaseModel) -> int:
    """Remove nodes and tensors that no graph output depends on."""
    before = len(graph.nodes)
    graph.cleanup()
    return before - len(graph.nodes)


@register("toposort")
def toposort(graph: gs.Graph, p: BaseModel) -> int:
    """Order nodes topologically (a valid ONNX graph requires it; rewrites may append nodes at the end)."""
    graph.toposort()
    return 0
