"""Vertical fusion into linear ops: Conv+BN, Conv+Add(bias), MatMul+Add -> Gemm, Transpose/Reshape chains,
and scalar Mul/Div folded into the weights of the linear op that produced the tensor."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from kiln.core.lazy import lazy_import
from kiln.stages.optimize.passes.util import (
    const,
    drop,
    new_const,
    only_consumer,
    producer,
    replace_uses,
    unique_name,
)
from kiln.stages.optimize.registry import register

gs = lazy_import("onnx_graphsurgeon")  # loaded when a pass first runs, not when the config is read


def _shape(t: gs.Tensor) -> list | None:
    return list(t.shape) if t.shape is not None else None


def _fold_into_output(graph: gs.Graph, node: gs.Node, follower: gs.Node) -> bool:
    """``follower`` was absorbed into ``node``: ``node`` now writes follower's output."""
    out = follower.outputs[0]
    follower.outputs = [
        gs.Variable(unique_name(graph, out.name + "_dead"))
    ]  # free the name first: a tensor has one writer
    node.outputs = [out]
    return True


def _conv_weight_bias(graph: gs.Graph, conv: gs.Node) -> tuple[np.ndarray, np.ndarray] | None:
    w = const(conv.inputs[1])
    if w is None or not np.issubdtype(w.dtype, np.floating):
        return None
    b = const(conv.inputs[2]) if len(conv.inputs) > 2 and conv.inputs[2].name else np.zeros(w.shape[0], w.dtype)
    return (w, b) if b is not None else None


def _set_conv_weights(graph: gs.Graph, conv: gs.Node, w: np.ndarray, b: np.ndarray) -> None:
    conv.inputs = [
        conv.inputs[0],
        new_const(graph, conv.inputs[1].name + "_fused", w),
        new_const(graph, (conv.name or "conv") + "_bias_fused", b),
    ]


@register("fold_conv_bn")
def fold_conv_bn(graph: gs.Graph, p: BaseModel) -> int:
    """Inference BatchNormalization right after a Conv whose output nothing else reads -> folded into its weights."""
    n = 0
    for bn in list(graph.nodes):
        if bn.op != "BatchNormalization" or any(o.outputs or o in graph.outputs for o in bn.outputs[1:]):
            continue  # training-mode BN (running statistics read downstream) is not a constant affine map
        conv = producer(bn.inputs[0], "Conv")
        if conv is None or only_consumer(graph, bn.inputs[0]) is not bn or bn.attrs.get("training_mode", 0):
            continue
        wb = _conv_weight_bias(graph, conv)
        stats = [const(t) for t in bn.inputs[1:5]]
        if wb is None or any(s is None for s in stats):
            continue
        w, b = wb
        gamma, beta, mean, var = (s.astype(np.float64) for s in stats)
        scale = gamma / np.sqrt(var + float(bn.attrs.get("epsilon", 1e-5)))
        w2 = (w.astype(np.float64) * scale.reshape(-1, *[1] * (w.ndim - 1))).astype(w.dtype)
        b2 = ((b.astype(np.float64) - mean) * scale + beta).astype(w.dtype)
        _set_conv_weights(graph, conv, w2, b2)
        _fold_into_output(graph, conv, bn)
        n += 1
    return n


def _channel_vector(v: np.ndarray, channels: int, rank: int) -> np.ndarray | None:
    """A constant added to a Conv output [N, C, ...] that is per-channel (shape [C,1,..], [1,C,1,..] or scalar)."""
    if v.ndim > rank:
        return None  # broadcasting would add axes to the output: not a bias
    if v.ndim == 0 or v.size == 1:
        return np.full(channels, v.ravel()[0], dtype=v.dtype)
    shape = list(v.shape)
    if len(shape) < rank - 1:
        return None
    full = [1] * (rank - len(shape)) + shape
    if full[0] != 1 or full[1] != channels or any(d != 1 for d in full[2:]):
        return None
    return v.reshape(channels)


def _constant_adds_after(graph: gs.Graph, op: str) -> Iterator[tuple[gs.Node, gs.Node, np.ndarray, int]]:
    """``(add, producer, constant, constant_side)`` for each Add of a constant to the output of an ``op`` node
    that nothing else reads. At most one side of an Add can match (the other must be a constant), and the
    nodes are listed up front, so callers may rewrite the Add they are given."""
    for add in list(graph.nodes):
        if add.op != "Add":
            continue
        for i in (0, 1):
            node, c = producer(add.inputs[i], op), const(add.inputs[1 - i])
            if node is not None and c is not None and only_consumer(graph, add.inputs[i]) is add:
                yield add, node, c, 1 - i
                break


@register("fold_conv_add")
def fold_conv_add(graph: gs.Graph, p: BaseModel) -> int:
    """Add of a per-channel constant right after a Conv whose output nothing else reads -> added into its bias."""
    n = 0
    for add, conv, c, _ in _constant_adds_after(graph, "Conv"):
        wb = _conv_weight_bias(graph, conv)
        vec = _channel_vector(c, wb[0].shape[0], wb[0].ndim) if wb is not None else None
        if vec is None or vec.dtype != wb[0].dtype:
            continue
        _set_conv_weights(graph, conv, wb[0], (wb[1] + vec).astype(wb[0].dtype))
        _fold_into_output(graph, conv, add)
        n += 1
    return n


@register("matmul_add_to_gemm")
def matmul_add_to_gemm(graph: gs.Graph, p: BaseModel) -> int:
    """MatMul of a 2-D input by a constant 2-D weight, then Add of a constant bias -> one Gemm (3-D inputs keep
    MatMul+Add: Gemm is 2-D only, and reshaping around it would add nodes)."""
    n = 0
    for add, mm, bias, bias_side in _constant_adds_after(graph, "MatMul"):
        a_shape, w = _shape(mm.inputs[0]), const(mm.inputs[1])
        if a_shape is None or len(a_shape) != 2 or w is None or w.ndim != 2:
            continue
        if (
            bias.ndim > 2
            or (bias.ndim >= 1 and bias.shape[-1] not in (1, w.shape[1]))
            or (bias.ndim == 2 and bias.shape[0] != 1)
            or bias.dtype != w.dtype
        ):
            continue  # Gemm's C must broadcast to [M, N] without depending on M
        add.op, add.attrs = "Gemm", {"alpha": 1.0, "beta": 1.0, "transA": 0, "transB": 0}
        add.inputs = [mm.inputs[0], mm.inputs[1], add.inputs[bias_side]]
        drop(mm)
        n += 1
    return n


@register("merge_transposes")
def merge_transposes(graph: gs.Graph, p: BaseModel) -> int:
    """Transpose of a Transpose -> one Transpose with the composed permutation (none if it is the identity)."""
    n = 0
    for node in list(graph.nodes):
        first = producer(node.inputs[0], "Transpose") if node.op == "Transpose" and node.inputs else None
        if first is None or "perm" not in node.attrs or "perm" not in first.attrs:
            continue
        p1, p2 = list(first.attrs["perm"]), list(node.attrs["perm"])
        node.attrs["perm"] = [p1[i] for i in p2]
        node.inputs[0] = first.inputs[0]
        n += 1
        if node.attrs["perm"] == list(range(len(p2))) and replace_uses(graph, node.outputs[0], node.inputs[0], node):
            drop(node)
    return n


@register("merge_reshapes")
def merge_reshapes(graph: gs.Graph, p: BaseModel) -> int:
    """Reshape (or Flatten/Squeeze/Unsqueeze) feeding a Reshape with a constant shape -> the last Reshape alone."""
    n = 0
    for node in list(graph.nodes):
        if node.op != "Reshape":
            continue
        first = producer(node.inputs[0], ("Reshape", "Flatten", "Squeeze", "Unsqueeze"))
        shape = const(node.inputs[1])
        if first is None or shape is None:
            continue
        if not node.attrs.get("allowzero", 0) and (shape == 0).any():
            continue  # a 0 copies an axis of the intermediate shape, which the merged Reshape no longer sees
        node.inputs[0] = first.inputs[0]
        n += 1
    return n


class ScaleParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    exact_only: bool = Field(
        True,
        description="fold only powers of two (bit-exact); otherwise any scalar "
        "(within rounding, checked by the safety net)",
    )


def _scalar(v: np.ndarray | None, div: bool, exact_only: bool) -> float | None:
    if v is None or v.size != 1 or v.ndim > 1 or not np.issubdtype(v.dtype, np.floating):  # [1,1,1] adds axes
        return None
    s = float(v.ravel()[0])
    if s == 0 or not np.isfinite(s):
        return None
    s = 1.0 / s if div else s
    mant, _ = np.frexp(s)
    return s if (not exact_only or abs(mant) == 0.5) else None


_SCALE_THROUGH = ("Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten")


def _linear_source(graph: gs.Graph, t: gs.Tensor) -> list[gs.Node] | None:
    """Walk up from ``t`` through private shape ops to ``[Add(const bias)] <- MatMul/Gemm/Conv(const weight)``;
    the chain of nodes whose constants scale with the output, or None."""
    while (node := producer(t)) is not None and node.op in _SCALE_THROUGH and only_consumer(graph, t) is not None:
        t = node.inputs[0]
    node = producer(t)
    if node is None or only_consumer(graph, t) is None:
        return None
    chain: list[gs.Node] = []
    if node.op == "Add":
        k = 1 if const(node.inputs[1]) is not None else 0 if const(node.inputs[0]) is not None else None
        inner = producer(node.inputs[1 - k]) if k is not None else None
        if inner is None or only_consumer(graph, node.inputs[1 - k]) is not node:
            return None
        chain, node = [node], inner
    if node.op not in ("MatMul", "Conv", "Gemm") or const(node.inputs[1]) is None:
        return None
    if node.op != "MatMul" and len(node.inputs) > 2 and node.inputs[2].name and const(node.inputs[2]) is None:
        return None  # a variable bias cannot be scaled ahead of time
    return chain + [node]


def _scale_chain(graph: gs.Graph, chain: list[gs.Node], s: float) -> None:
    for node in chain:
        if node.op == "Add":
            k = 1 if const(node.inputs[1]) is not None else 0
            v = const(node.inputs[k])
            node.inputs[k] = new_const(graph, node.inputs[k].name + "_scaled", (v * s).astype(v.dtype))
        else:
            idx = [1] + ([2] if len(node.inputs) > 2 and node.inputs[2].name else [])
            for j in idx:
                v = const(node.inputs[j])
                node.inputs[j] = new_const(graph, node.inputs[j].name + "_scaled", (v * s).astype(v.dtype))


@register("fold_scalar_mul", ScaleParams)
def fold_scalar_mul(graph: gs.Graph, p: ScaleParams) -> int:
    """Mul/Div of a tensor by a scalar constant, where the tensor (or one MatMul operand) comes from a linear op
    with constant weights -> scale those weights instead (e.g. attention's 1/sqrt(d) into the Q projection)."""
    n = 0
    for node in list(graph.nodes):
        if node.op not in ("Mul", "Div"):
            continue
        k = (
            1
            if const(node.inputs[1]) is not None
            else 0
            if node.op == "Mul" and const(node.inputs[0]) is not None
            else None
        )
        s = _scalar(const(node.inputs[k]), node.op == "Div", p.exact_only) if k is not None else None
        if s is None:
            continue
        x = node.inputs[1 - k]
        chain = _linear_source(graph, x)
        mm = producer(x, "MatMul")
        if chain is None and mm is not None and only_consumer(graph, x) is node:
            # (A @ B) * s: scale whichever operand leads back to constant weights (attention's Q or K side)
            chain = _linear_source(graph, mm.inputs[0]) or _linear_source(graph, mm.inputs[1])
        if chain is None or (x.dtype is not None and np.dtype(x.dtype) != const(node.inputs[k]).dtype):
            continue
        if not replace_uses(graph, node.outputs[0], x, via=node):
            continue
        _scale_chain(graph, chain, s)
        drop(node)
        n += 1
    return n
