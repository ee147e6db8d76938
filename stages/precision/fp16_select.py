"""Which nodes of a graph must stay FP32 in an FP16 engine, and why.

onnxconverter-common only blocks op types and node names it is given; deciding *which* (sensitive ops,
LayerNorm written out as elementwise ops, long reductions, tensors out of FP16 range) is done here.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import onnx
from onnx import numpy_helper

from kiln.core.errors import refuse_unknown_names
from kiln.stages.precision.casts import FLOAT_ONNX
from kiln.stages.precision.config import FP16Config

log = logging.getLogger("kiln.precision")

FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE}
# Reductions that add their elements up (a max or a min adds nothing: in FP16 it is the FP32 result rounded)
SUMMING_OPS = {"ReduceSum", "ReduceMean", "ReduceL1", "GlobalAveragePool"}
# Ops whose outputs are shapes or indices, never the model's float values: no reason to keep them FP32. Ops that
# only move float values (Reshape, Transpose, Concat, Cast...) add no rounding error, so nothing selects them for
# precision, but a value beyond FP16's range overflows in them like anywhere else: range checks and the fallback
# must be able to keep them FP32 (else an FP32 island broken by a Reshape still overflows).
INDEX_OPS = {"Shape", "Size", "ConstantOfShape", "Range"}
SEQUENCE_OPS = {"ConcatFromSequence", "SplitToSequence"}  # besides the Sequence* ops
PERIODIC_OPS = {"Sin", "Cos", "Tan"}
# Ops a phase is computed with from positions, timesteps and frequencies: cheap elementwise and shape ops. A
# Gather from a float table (an embedding), MatMul, Gemm, Conv and any other op compute the model's activations,
# not a phase, even from integer inputs (a vocoder's codes): the walk stops there (but see :func:`_phase_op`).
PHASE_OPS = {
    *("Cast", "CastLike", "Identity", "Unsqueeze", "Squeeze", "Reshape", "Flatten", "Expand", "Tile"),
    *("Concat", "Split", "Slice", "Transpose", "Gather", "Where", "Range", "Shape", "Size"),
    *("Constant", "ConstantOfShape", "Mul", "Div", "Add", "Sub", "Neg", "Abs", "Mod", "Floor", "Ceil", "Round"),
    *("Exp", "Log", "Pow", "Sqrt", "Reciprocal", "Min", "Max", "Clip"),
}
# A float graph input with at most this many values a sample (a timestep, a position, coordinates) may feed a
# phase; a bigger one is the model's data, whose processing is no phase computation.
SMALL_INPUT = 64


def select_fp32_nodes(
    model: onnx.ModelProto, cfg: FP16Config, activation_amax: dict[str, float] | None = None
) -> dict[str, str]:
    """``{node name: reason}`` for every node to keep in FP32. ``model`` must be shape-inferred and named."""
    keep: dict[str, str] = {}
    for n in model.graph.node:
        if n.op_type in cfg.fp32_ops:
            keep.setdefault(n.name, f"{n.op_type} is precision-sensitive (fp16.fp32_ops)")
        if n.name in cfg.fp32_nodes:
            keep.setdefault(n.name, "listed in fp16.fp32_nodes")
    for name, reason in unconvertible_ops(model).items():
        keep.setdefault(name, reason)
    if cfg.phase_fp32:
        phases = phase_nodes(model, set(keep))
        for name, reason in phases.items():
            keep.setdefault(name, reason)
        if phases:
            log.info(
                "fp16: %d nodes computing a Sin/Cos phase kept FP32 (fp16.phase_fp32): FP16 rounds a phase near "
                "1000 by up to 0.25 rad",
                len(phases),
            )
    if cfg.decomposed_layernorm:
        for name in decomposed_layernorm_nodes(model):
            keep.setdefault(name, "part of a LayerNorm written as elementwise ops")
    for name, reason in long_reductions(model, cfg.long_reduction).items():
        keep.setdefault(name, reason)
    if cfg.range_check:
        for name, reason in weight_range_violations(model, cfg.range_limit).items():
            keep.setdefault(name, reason)
        for name, reason in activation_range_violations(model, activation_amax or {}, cfg.range_limit).items():
            keep.setdefault(name, reason)
    return keep


def check_fp32_nodes(model: onnx.ModelProto, cfg: FP16Config) -> None:
    """Names in ``fp16.fp32_nodes`` that the graph does not have are one error, with the closest real names, as
    for ``calibration.exclude_nodes``: a typo would otherwise keep nothing in FP32, silently."""
    nodes = [n.name for n in model.graph.node]
    known = set(nodes)
    refuse_unknown_names([("precision.fp16.fp32_nodes", "node", n, nodes) for n in cfg.fp32_nodes if n not in known])


def unconvertible_ops(model: onnx.ModelProto) -> dict[str, str]:
    """Control flow and sequences stay FP32: onnxconverter-common retypes tensors inside subgraphs without
    their outer readers and writers, and never retypes sequence types or SequenceEmpty's dtype, while ONNX
    Runtime's converter retypes sequences but casts them like tensors; either way converting them yields an
    invalid graph (an nn.EmbeddingBag export has a Loop over sequences). Any node reading or writing a
    sequence counts, found by the types in ``model``'s value_info (shape-inferred)."""
    sequences = sequence_values(model)
    out: dict[str, str] = {}
    for n in model.graph.node:
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in n.attribute):
            out[n.name] = f"{n.op_type} has subgraphs (control flow), which FP16 conversion does not support"
        elif n.op_type in SEQUENCE_OPS or n.op_type.startswith("Sequence") or sequences & {*n.input, *n.output}:
            out[n.name] = f"{n.op_type} works on sequences, which FP16 conversion does not support"
    return out


def phase_nodes(model: onnx.ModelProto, kept: set[str]) -> dict[str, str]:
    """``{node: reason}`` for the float nodes computing the argument of a periodic node in ``kept`` (``t * freqs``
    of a timestep embedding, with its Cast, Unsqueeze, Mul...) from phase sources only (:func:`phase_values`).

    FP16's spacing is 0.5 between 512 and 1024: a phase near 1000 rounds by up to 0.25 rad, so Sin/Cos in FP32
    alone do not help when their argument was computed in FP16. The chain reads no big activation: it is tiny.
    """
    sources = phase_values(model)
    types = _types(model)
    producers = {o: n for n in model.graph.node for o in n.output}
    out: dict[str, str] = {}
    for node in model.graph.node:
        if node.op_type not in PERIODIC_OPS or node.name not in kept:
            continue
        reason = (
            f"computes the phase of {node.op_type} '{node.name}' (fp16.phase_fp32): FP16 rounds a phase near 1000 "
            "by up to 0.25 rad"
        )
        seen: set[str] = set()
        todo = [i for i in node.input if i in sources]
        while todo:  # through nodes kept already (an Exp making the frequencies): their inputs are phase too
            p = producers.get(todo.pop())
            if p is None or p.name in seen:
                continue
            seen.add(p.name)
            if not any(types.get(o, onnx.TensorProto.FLOAT) in FLOAT_ONNX for o in p.output):
                continue  # integer values are exact: nothing above them to keep
            if p.name not in kept:
                out.setdefault(p.name, reason)
            todo += [i for i in p.input if i in sources]
    return out


def phase_values(model: onnx.ModelProto) -> set[str]:
    """Tensors that may carry a phase: computed by cheap elementwise and shape ops (:func:`_phase_op`) only from
    initializers, constants, integer tensors (exact, wherever they come from) and float graph inputs of at most
    ``SMALL_INPUT`` values a sample; never through a periodic op (what reads its output is the model, not a phase),
    an embedding lookup, a matrix product or control flow. A big activation never is one."""
    types = _types(model)
    graph = model.graph
    found = {i.name for i in graph.initializer} | {i.name for i in graph.input if _small_input(i)}

    def source(name: str) -> bool:
        return not name or name in found or types.get(name, onnx.TensorProto.FLOAT) not in FLOAT_ONNX

    tables = _float_tables(model)
    shapes = _shapes(model)
    for n in graph.node:
        if not _phase_op(n, tables, shapes):
            continue
        if n.op_type in ("Shape", "Size") or all(source(i) for i in n.input):
            found.update(n.output)
    return found


def _phase_op(node: onnx.NodeProto, tables: dict[str, int], shapes: dict[str, list[int | None]]) -> bool:
    """Whether ``node`` may compute a phase (:data:`PHASE_OPS`): not a Gather from a float table of two axes or
    more (an embedding lookup: its output is the model's activation); a MatMul only as the outer product of
    positions and frequencies (Hugging Face's rotary embedding: ``inv_freq[:, None] @ positions[None]``), one
    whose inner axis is 1 or that reads no weight, only values computed from the phase's sources."""
    if node.op_type == "Gather":
        return tables.get(node.input[0], 0) < 2
    if node.op_type == "MatMul":
        first = shapes.get(node.input[0]) or []
        return (len(first) >= 2 and first[-1] == 1) or not any(i in tables for i in node.input)
    return node.op_type in PHASE_OPS


def _float_tables(model: onnx.ModelProto) -> dict[str, int]:
    """Float initializers and Constant outputs (weights, tables), each with its number of axes."""
    tables = {i.name: len(i.dims) for i in model.graph.initializer if i.data_type in FLOAT_ONNX}
    for n in model.graph.node:
        if n.op_type == "Constant":
            value = next((a.t for a in n.attribute if a.name == "value"), None)
            if value is not None and value.data_type in FLOAT_ONNX:
                tables[n.output[0]] = len(value.dims)
    return tables


def _small_input(value: onnx.ValueInfoProto) -> bool:
    """Whether a graph input is non-float, or float with a known count of at most ``SMALL_INPUT`` values a sample
    (its first axis is the batch)."""
    t = value.type.tensor_type
    if t.elem_type not in FLOAT_ONNX:
        return True
    dims = list(t.shape.dim)[1:]
    return all(d.HasField("dim_value") for d in dims) and math.prod(d.dim_value for d in dims) <= SMALL_INPUT


def _types(model: onnx.ModelProto) -> dict[str, int]:
    graph = model.graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*graph.value_info, *graph.input, *graph.output]}
    return types | {i.name: i.data_type for i in graph.initializer}


def sequence_values(model: onnx.ModelProto) -> set[str]:
    """Names of the sequence-typed values of the main graph (its inputs, outputs and value_info)."""
    graph = model.graph
    return {v.name for v in [*graph.input, *graph.output, *graph.value_info] if v.type.HasField("sequence_type")}


def _consumers(model: onnx.ModelProto) -> dict[str, list[onnx.NodeProto]]:
    out: dict[str, list[onnx.NodeProto]] = {}
    for n in model.graph.node:
        for i in n.input:
            out.setdefault(i, []).append(n)
    return out


def _only(nodes: list[onnx.NodeProto], *ops: str) -> onnx.NodeProto | None:
    hits = [n for n in nodes if n.op_type in ops]
    return hits[0] if len(hits) == 1 else None


def decomposed_layernorm_nodes(model: onnx.ModelProto) -> list[str]:
    """Match ``x - mean(x)`` -> square -> mean -> +eps -> sqrt -> divide (or * reciprocal), then the
    optional scale Mul and shift Add: LayerNorm as exporters write it without the fused op."""
    cons = _consumers(model)
    found: list[str] = []
    for r1 in (n for n in model.graph.node if n.op_type == "ReduceMean"):
        x = r1.input[0]
        sub = next(
            (c for c in cons.get(r1.output[0], []) if c.op_type == "Sub" and list(c.input) == [x, r1.output[0]]), None
        )
        if sub is None:
            continue
        centered = sub.output[0]
        sq = next(
            (
                c
                for c in cons.get(centered, [])
                if c.op_type == "Pow" or (c.op_type == "Mul" and list(c.input) == [centered, centered])
            ),
            None,
        )
        r2 = _only(cons.get(sq.output[0], []), "ReduceMean") if sq else None
        add = _only(cons.get(r2.output[0], []), "Add") if r2 else None
        sqrt = _only(cons.get(add.output[0], []), "Sqrt") if add else None
        if sqrt is None:
            continue
        chain = [r1, sub, sq, r2, add, sqrt]
        div = next((c for c in cons.get(sqrt.output[0], []) if c.op_type == "Div" and c.input[0] == centered), None)
        if div is None:  # x_centered * (1 / sqrt(var + eps))
            rec = _only(cons.get(sqrt.output[0], []), "Reciprocal")
            div = _only(cons.get(rec.output[0], []), "Mul") if rec else None
            chain += [rec] if rec else []
        if div is None:
            continue
        chain.append(div)
        tail = div
        for op in ("Mul", "Add"):  # gamma, beta
            nxt = _only(cons.get(tail.output[0], []), op)
            if nxt is None:
                break
            chain.append(nxt)
            tail = nxt
        found += [n.name for n in chain if n is not None]
    return found


def _shapes(model: onnx.ModelProto) -> dict[str, list[int | None]]:
    """Each tensor's shape as inference left it (None: an axis of unknown size), the initializers' too."""
    shapes: dict[str, list[int | None]] = {t.name: list(t.dims) for t in model.graph.initializer}
    for vi in [*model.graph.value_info, *model.graph.input, *model.graph.output]:
        t = vi.type.tensor_type
        if t.HasField("shape"):
            shapes[vi.name] = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
    return shapes


def _reduce_axes(n: onnx.NodeProto, rank: int, inits: dict[str, onnx.TensorProto]) -> list[int]:
    axes: list[int] | None = None
    for a in n.attribute:
        if a.name == "axes":
            axes = list(a.ints)
    if axes is None and len(n.input) > 1 and n.input[1] in inits:  # opset 18: axes is an input
        axes = [int(v) for v in numpy_helper.to_array(inits[n.input[1]]).ravel()]
    if axes is None or not axes:
        axes = list(range(rank))  # reduce over all axes (noop_with_empty_axes aside)
    return [a % rank for a in axes]


def long_reductions(model: onnx.ModelProto, threshold: int) -> dict[str, str]:
    """Reductions that sum (and average pools) over >= ``threshold`` elements: FP16 sums lose small addends."""
    shapes = _shapes(model)
    inits = {i.name: i for i in model.graph.initializer}
    out: dict[str, str] = {}
    for n in model.graph.node:
        if n.op_type not in SUMMING_OPS:
            continue
        shape = shapes.get(n.input[0])
        if shape is None:
            out[n.name] = f"{n.op_type} over an input of unknown shape"
            continue
        axes = list(range(2, len(shape))) if n.op_type == "GlobalAveragePool" else _reduce_axes(n, len(shape), inits)
        dims = [shape[a] for a in axes]
        count = math.prod(d for d in dims if d) if None not in dims else None
        if count is None or count >= threshold:
            what = "a dynamic axis" if count is None else f"{count} elements"
            out[n.name] = f"{n.op_type} reduces over {what} (fp16.long_reduction={threshold})"
    return out


def weight_range_violations(model: onnx.ModelProto, limit: float) -> dict[str, str]:
    """Nodes reading a float initializer with values beyond ``limit`` or that mostly underflow FP16's
    smallest subnormal (2**-24) — the converter would otherwise clamp them silently."""
    bad: dict[str, str] = {}
    for init in model.graph.initializer:
        if init.data_type not in FLOAT_TYPES:
            continue
        w = np.abs(numpy_helper.to_array(init))
        if w.size == 0:
            continue
        amax = float(w.max())
        nonzero = w[w > 0]
        tiny = float(np.mean(nonzero < 2.0**-24)) if nonzero.size else 0.0
        if amax > limit:
            bad[init.name] = f"weight '{init.name}' reaches {amax:.3g} (> {limit:g}, FP16 max 65504)"
        elif tiny > 0.01:
            bad[init.name] = f"weight '{init.name}' has {tiny:.0%} of values below FP16's smallest subnormal"
    return {n.name: bad[i] for n in model.graph.node for i in n.input if i in bad}


def activation_range_violations(model: onnx.ModelProto, amax: dict[str, float], limit: float) -> dict[str, str]:
    """A tensor whose calibrated magnitude exceeds ``limit`` overflows wherever it is FP16: keep the node that
    makes it and every node that reads it (a Cast to FP16 on their input would overflow too)."""
    out: dict[str, str] = {}
    cons = _consumers(model)
    producers = {o: n for n in model.graph.node for o in n.output}
    for name, value in amax.items():
        if not (value > limit) or name not in producers and name not in cons:
            continue
        reason = f"activation '{name}' reaches {value:.3g} on calibration data (> {limit:g})"
        for n in [producers.get(name), *cons.get(name, [])]:
            if n is not None and n.op_type not in INDEX_OPS:
                out.setdefault(n.name, reason)
    return out
