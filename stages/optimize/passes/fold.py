"""Constant folding to a fixpoint (shape subgraphs included), cleanup and topological sort."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from kiln.core.lazy import lazy_import
from kiln.stages.optimize.passes.shapes import fold_shapes, static_reshape_target
from kiln.stages.optimize.passes.util import RANDOM_OPS, const, known_shape, new_const
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
                node.attrs["allowzero"] = 0
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
        node.attrs["allowzero"] = 0
        n += 1
    return n


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
        with _quiet_gs():
            # A random op has no variable inputs, so it looks foldable; folding would freeze one draw forever.
            graph.fold_constants(
                fold_shapes=True,
                size_threshold=p.size_threshold,
                error_ok=True,
                should_exclude_node=lambda node: node.op in RANDOM_OPS,
            )
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
