"""Pattern fusion to standard ONNX ops: decomposed LayerNorm -> LayerNormalization (opset >= 17), erf/tanh
GELU -> Gelu (opset >= 20) or else one canonical erf form, and the attention Softmax in TensorRT's form."""

from __future__ import annotations

import math

import numpy as np
from pydantic import BaseModel

from kiln.core.lazy import lazy_import
from kiln.stages.optimize.passes.util import (
    const,
    known_shape,
    new_const,
    node_name,
    only_consumer,
    producer,
    unique_name,
)
from kiln.stages.optimize.registry import register

gs = lazy_import("onnx_graphsurgeon")  # loaded when a pass first runs, not when the config is read


def _scalar(t: gs.Tensor) -> float | None:
    """The value of a one-element constant of rank 0 or 1. A higher-rank one is not a scalar: broadcasting
    it can raise the other operand's rank, which a fused op would drop."""
    v = const(t)
    return float(v.ravel()[0]) if v is not None and v.size == 1 and v.ndim <= 1 else None


def _other(node: gs.Node, t: gs.Tensor) -> gs.Tensor | None:
    """The input of a binary ``node`` that is not ``t`` (None if ``t`` is not an input)."""
    if len(node.inputs) != 2:
        return None
    if node.inputs[0] is t:
        return node.inputs[1]
    return node.inputs[0] if node.inputs[1] is t else None


def _readers(t: gs.Tensor) -> list[gs.Node]:
    return list(t.outputs)


def _rewire(graph: gs.Graph, last: gs.Node, new: gs.Node) -> None:
    """``new`` takes over ``last``'s output tensor (and so its readers and name)."""
    out = last.outputs[0]
    last.outputs[0] = gs.Variable(unique_name(graph, out.name + "_dead"))
    new.outputs = [out]
    graph.nodes.append(new)


def _reduce_axes(node: gs.Node) -> list[int] | None:
    if node.op != "ReduceMean" or not node.attrs.get("keepdims", 1):
        return None
    if "axes" in node.attrs:
        return list(node.attrs["axes"])
    v = const(node.inputs[1]) if len(node.inputs) > 1 else None
    return [int(a) for a in v.ravel()] if v is not None else None


def _trailing(axes: list[int], rank: int | None) -> int | None:
    """The LayerNormalization ``axis`` if ``axes`` are the last k axes, else None."""
    if not axes:  # opset 18 empty axes: all axes, or none with noop_with_empty_axes: not a LayerNorm's
        return None
    if rank is None:
        if all(a < 0 for a in axes):
            norm = sorted(axes)
            return norm[0] if norm == list(range(-len(axes), 0)) else None
        return None
    norm = sorted(a % rank for a in axes)
    return norm[0] - rank if norm == list(range(rank - len(axes), rank)) else None


def _private(graph: gs.Graph, t: gs.Tensor, reader: gs.Node) -> bool:
    return only_consumer(graph, t) is reader


def _affine_param(v: np.ndarray, norm_shape: list[int], rank: int) -> np.ndarray | None:
    """gamma/beta broadcast to the normalized shape, if it does not broadcast along the other axes (nor add
    axes to an input of rank ``rank``)."""
    k = len(norm_shape)
    if v.ndim > rank or (v.ndim > k and any(d != 1 for d in v.shape[:-k])):
        return None
    v = v.reshape(v.shape[-k:]) if v.ndim > k else v
    try:
        return np.ascontiguousarray(np.broadcast_to(v, norm_shape))
    except ValueError:
        return None


def _match_layernorm(graph: gs.Graph, dv: gs.Node) -> dict | None:
    d, std = dv.inputs
    sub, sqrt = producer(d, "Sub"), producer(std, "Sqrt")
    if sub is None or sqrt is None:
        return None
    x, rm1 = sub.inputs[0], producer(sub.inputs[1], "ReduceMean")
    add_eps = producer(sqrt.inputs[0], "Add")
    if rm1 is None or rm1.inputs[0] is not x or add_eps is None:
        return None
    var_t = next((t for t in add_eps.inputs if _scalar(t) is None), None)
    eps = next((_scalar(t) for t in add_eps.inputs if _scalar(t) is not None), None)
    rm2 = producer(var_t, "ReduceMean") if var_t is not None else None
    sq = producer(rm2.inputs[0], ("Pow", "Mul")) if rm2 is not None else None
    if eps is None or sq is None or sq.inputs[0] is not d:
        return None
    if (sq.op == "Pow" and _scalar(sq.inputs[1]) != 2.0) or (sq.op == "Mul" and sq.inputs[1] is not d):
        return None
    axes1, axes2, shape = _reduce_axes(rm1), _reduce_axes(rm2), known_shape(x)
    axis = _trailing(axes1, len(shape) if shape else None) if axes1 is not None and axes1 == axes2 else None
    if axis is None or shape is None or not all(isinstance(v, int) for v in shape[axis:]):
        return None
    if any(r not in (sq, dv) for r in d.outputs) or not all(
        _private(graph, t, r)
        for t, r in (
            (sub.inputs[1], sub),
            (rm2.outputs[0], add_eps),
            (add_eps.outputs[0], sqrt),
            (std, dv),
            (rm2.inputs[0], rm2),
        )
    ):
        return None
    return {
        "x": x,
        "axis": axis,
        "eps": eps,
        "norm_shape": [int(v) for v in shape[axis:]],
        "rank": len(shape),
        "last": dv,
    }


def _absorb_affine(graph: gs.Graph, m: dict, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Extend the match over a following Mul(gamma) and Add(beta); return (gamma, beta)."""
    gamma, beta = np.ones(m["norm_shape"], dtype), np.zeros(m["norm_shape"], dtype)
    for op in ("Mul", "Add"):
        out = m["last"].outputs[0]
        nxt = only_consumer(graph, out)
        c = const(_other(nxt, out)) if nxt is not None and nxt.op == op else None
        v = _affine_param(c, m["norm_shape"], m["rank"]) if c is not None and c.dtype == dtype else None
        if v is None:
            break
        if op == "Mul":
            gamma, beta = v.copy(), beta * v
        else:
            beta = beta + v
        m["last"] = nxt
    return gamma.astype(dtype), beta.astype(dtype)


@register("fuse_layernorm")
def fuse_layernorm(graph: gs.Graph, p: BaseModel) -> int:
    """ReduceMean/Sub/Pow/ReduceMean/Add/Sqrt/Div (+Mul gamma, +Add beta) -> LayerNormalization (opset >= 17)."""
    if graph.opset < 17:
        return 0
    n = 0
    for dv in list(graph.nodes):
        m = _match_layernorm(graph, dv) if dv.op == "Div" and dv.outputs else None
        if m is None or m["x"].dtype is None:
            continue
        dtype = np.dtype(m["x"].dtype)
        gamma, beta = _absorb_affine(graph, m, dtype)
        ln = gs.Node(
            "LayerNormalization",
            node_name(graph, "layernorm"),
            attrs={"axis": m["axis"], "epsilon": float(m["eps"])},
            inputs=[m["x"], new_const(graph, "ln_gamma", gamma), new_const(graph, "ln_beta", beta)],
        )
        _rewire(graph, m["last"], ln)
        n += 1
    return n


def _near(v: float | None, target: float) -> bool:
    return v is not None and abs(v - target) <= 1e-5 * abs(target)


def _gelu_tail(graph: gs.Graph, x: gs.Tensor, h: gs.Tensor) -> tuple[gs.Node, str] | None:
    """From h = 1 + erf(..) (or 1 + tanh(..)), the Muls by x and 0.5 in any grouping -> (last node, form)."""
    m1 = only_consumer(graph, h)
    if m1 is None or m1.op != "Mul":
        return None
    o = _other(m1, h)
    m2 = only_consumer(graph, m1.outputs[0])
    if o is x and m2 is not None and m2.op == "Mul" and _near(_scalar(_other(m2, m1.outputs[0])), 0.5):
        return m2, "x_then_half"
    if _near(_scalar(o), 0.5) and m2 is not None and m2.op == "Mul" and _other(m2, m1.outputs[0]) is x:
        return m2, "half_then_x"
    half = producer(o, "Mul") if o is not None else None
    if half is not None and _private(graph, o, m1) and x in half.inputs and _near(_scalar(_other(half, x)), 0.5):
        return m1, "half_x_first"
    return None


def _match_erf_gelu(graph: gs.Graph, erf: gs.Node) -> tuple[gs.Tensor, gs.Node, str, gs.Node] | None:
    scale = producer(erf.inputs[0], ("Div", "Mul"))
    if scale is None or not _private(graph, erf.inputs[0], erf):
        return None
    x = scale.inputs[0]
    c = _scalar(scale.inputs[1])
    if not (_near(c, math.sqrt(2)) if scale.op == "Div" else _near(c, 1 / math.sqrt(2))):
        return None
    add = only_consumer(graph, erf.outputs[0])
    if add is None or add.op != "Add" or not _near(_scalar(_other(add, erf.outputs[0])), 1.0):
        return None
    tail = _gelu_tail(graph, x, add.outputs[0])
    return (x, tail[0], f"{scale.op}_{tail[1]}", scale) if tail else None


def _match_tanh_gelu(graph: gs.Graph, th: gs.Node) -> tuple[gs.Tensor, gs.Node] | None:
    outer = producer(th.inputs[0], "Mul")
    if outer is None or not _private(graph, th.inputs[0], th):
        return None
    inner_t = next((t for t in outer.inputs if _scalar(t) is None), None)
    if not _near(_scalar(_other(outer, inner_t)), math.sqrt(2 / math.pi)) if inner_t is not None else True:
        return None
    inner = producer(inner_t, "Add")
    cube_mul = next((producer(t, "Mul") for t in (inner.inputs if inner else []) if producer(t, "Mul")), None)
    if inner is None or cube_mul is None:
        return None
    x = _other(inner, cube_mul.outputs[0])
    cube_t = next((t for t in cube_mul.inputs if _scalar(t) is None), None)
    if x is None or cube_t is None or not _near(_scalar(_other(cube_mul, cube_t)), 0.044715):
        return None
    pw = producer(cube_t, "Pow")
    if pw is None or pw.inputs[0] is not x or _scalar(pw.inputs[1]) != 3.0:
        return None
    add = only_consumer(graph, th.outputs[0])
    if add is None or add.op != "Add" or not _near(_scalar(_other(add, th.outputs[0])), 1.0):
        return None
    tail = _gelu_tail(graph, x, add.outputs[0])
    return (x, tail[0]) if tail else None


def _canonical_erf_gelu(graph: gs.Graph, x: gs.Tensor, last: gs.Node) -> None:
    """x / sqrt(2) -> Erf -> +1 -> * x -> * 0.5: the one erf form ONNX Runtime and TensorRT both fuse."""
    dt = np.dtype(x.dtype)
    names = [unique_name(graph, f"gelu_{s}") for s in ("div", "erf", "add", "mul")]
    ts = [gs.Variable(nm, dtype=x.dtype) for nm in names]
    nodes = [
        gs.Node(
            "Div",
            node_name(graph, names[0]),
            inputs=[x, new_const(graph, "gelu_sqrt2", np.array(math.sqrt(2), dt))],
            outputs=[ts[0]],
        ),
        gs.Node("Erf", node_name(graph, names[1]), inputs=[ts[0]], outputs=[ts[1]]),
        gs.Node(
            "Add",
            node_name(graph, names[2]),
            inputs=[ts[1], new_const(graph, "gelu_one", np.array(1, dt))],
            outputs=[ts[2]],
        ),
        gs.Node("Mul", node_name(graph, names[3]), inputs=[x, ts[2]], outputs=[ts[3]]),
    ]
    graph.nodes.extend(nodes)
    _rewire(
        graph,
        last,
        gs.Node("Mul", node_name(graph, "gelu_half"), inputs=[ts[3], new_const(graph, "gelu_half", np.array(0.5, dt))]),
    )


@register("fuse_gelu")
def fuse_gelu(graph: gs.Graph, p: BaseModel) -> int:
    """erf or tanh GELU subgraphs -> Gelu (opset >= 20); below 20, erf GELU -> one canonical Div/Erf/Add/Mul/Mul."""
    n = 0
    for node in list(graph.nodes):
        if not node.outputs:
            continue
        if node.op == "Erf" and (m := _match_erf_gelu(graph, node)) is not None:
            x, last, form, _ = m
            if x.dtype is None:
                continue
            if graph.opset >= 20:
                _rewire(
                    graph, last, gs.Node("Gelu", node_name(graph, "gelu"), attrs={"approximate": "none"}, inputs=[x])
                )
            elif form != "Div_x_then_half":
                _canonical_erf_gelu(graph, x, last)
            else:
                continue  # already canonical
            n += 1
        elif node.op == "Tanh" and graph.opset >= 20 and (t := _match_tanh_gelu(graph, node)) is not None:
            _rewire(
                graph, t[1], gs.Node("Gelu", node_name(graph, "gelu"), attrs={"approximate": "tanh"}, inputs=[t[0]])
            )
            n += 1
    return n


@register("canonical_softmax")
def canonical_softmax(graph: gs.Graph, p: BaseModel) -> int:
    """Softmax over the last axis written as axis=-1 (opset >= 13), the form TensorRT's attention fusion matches."""
    if graph.opset < 13:
        return 0  # before 13 Softmax flattens to 2-D: the axis means something else
    n = 0
    for node in graph.nodes:
        shape = known_shape(node.inputs[0]) if node.op == "Softmax" else None
        axis = node.attrs.get("axis", -1) if node.op == "Softmax" else -1
        if shape is not None and axis >= 0 and axis == len(shape) - 1:
            node.attrs["axis"] = -1
            n += 1
    return n
