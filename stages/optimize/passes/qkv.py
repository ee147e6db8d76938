"""Horizontal fusion: MatMuls that read the same input with constant weights (attention's Q, K and V
projections) -> one MatMul over the concatenated weights (+ one bias Add) and a Split."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from kiln.core.lazy import lazy_import
from kiln.stages.optimize.passes.util import (
    const,
    new_const,
    node_name,
    only_consumer,
    unique_name,
)
from kiln.stages.optimize.registry import register

gs = lazy_import("onnx_graphsurgeon")  # loaded when a pass first runs, not when the config is read


class QkvParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    min_branches: int = Field(2, ge=2, description="merge when at least this many MatMuls share one input")
    max_branches: int = Field(
        8, ge=2, description="do not merge more branches than this (very wide merges only add a large Split)"
    )


def _branch(graph: gs.Graph, mm: gs.Node) -> tuple[np.ndarray, np.ndarray | None, gs.Tensor] | None:
    """(weight, bias or None, the tensor the branch delivers) of a MatMul [+ Add(const bias)] branch."""
    w = const(mm.inputs[1])
    if w is None or w.ndim != 2:
        return None
    add = only_consumer(graph, mm.outputs[0])
    if add is not None and add.op == "Add":
        other = add.inputs[1] if add.inputs[0] is mm.outputs[0] else add.inputs[0]
        b = const(other)
        if b is not None and b.shape == (w.shape[1],) and b.dtype == w.dtype:
            return w, b, add.outputs[0]
    return w, None, mm.outputs[0]


@register("merge_qkv", QkvParams)
def merge_qkv(graph: gs.Graph, p: QkvParams) -> int:
    """MatMuls reading one input by constant 2-D weights (Q, K, V) -> one MatMul (+ bias Add) and a Split."""
    groups: dict[int, list[gs.Node]] = defaultdict(list)
    for node in graph.nodes:
        if node.op == "MatMul" and isinstance(node.inputs[0], gs.Variable) and const(node.inputs[1]) is not None:
            groups[id(node.inputs[0])].append(node)
    n = 0
    for mms in groups.values():
        branches = [(mm, _branch(graph, mm)) for mm in mms]
        branches = [(mm, b) for mm, b in branches if b is not None]
        if not p.min_branches <= len(branches) <= p.max_branches:
            continue
        k, dtype = branches[0][1][0].shape[0], branches[0][1][0].dtype
        if any(b[0].shape[0] != k or b[0].dtype != dtype for _, b in branches):
            continue
        _merge(graph, branches)
        n += 1
    return n


def _merge(graph: gs.Graph, branches: list) -> None:
    x = branches[0][0].inputs[0]
    with_bias = all(b[1] is not None for _, b in branches)
    w = np.concatenate([b[0] for _, b in branches], axis=1)
    outs = [b[2] if with_bias else mm.outputs[0] for mm, b in branches]
    for t in outs:  # free the branch tensors' names: the Split will write them
        writer = t.inputs[0]
        writer.outputs[writer.outputs.index(t)] = gs.Variable(unique_name(graph, t.name + "_dead"))
    y = gs.Variable(unique_name(graph, "qkv_matmul_out"), dtype=x.dtype)
    graph.nodes.append(
        gs.Node("MatMul", node_name(graph, "qkv_matmul"), inputs=[x, new_const(graph, "qkv_weight", w)], outputs=[y])
    )
    if with_bias:
        b = np.concatenate([b[1] for _, b in branches])
        yb = gs.Variable(unique_name(graph, "qkv_add_out"), dtype=x.dtype)
        graph.nodes.append(
            gs.Node("Add", node_name(graph, "qkv_add"), inputs=[y, new_const(graph, "qkv_bias", b)], outputs=[yb])
        )
        y = yb
    sizes = np.array([b[0].shape[1] for _, b in branches], dtype=np.int64)
    if graph.opset >= 13:
        split = gs.Node(
            "Split",
            node_name(graph, "qkv_split"),
            attrs={"axis": -1},
            inputs=[y, new_const(graph, "qkv_split_sizes", sizes)],
            outputs=outs,
        )
    else:  # before opset 13 the sizes are an attribute
        split = gs.Node(
            "Split",
            node_name(graph, "qkv_split"),
            attrs={"axis": -1, "split": sizes.tolist()},
            inputs=[y],
            outputs=outs,
        )
    graph.nodes.append(split)
