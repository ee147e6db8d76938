"""Comparing a reduced-precision graph with the FP32 one: output agreement, and per-tensor errors to find
the nodes that introduce the difference (like Polygraphy's ``--onnx-outputs mark all`` comparison)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx

from kiln.core.compare import MASK_MIN, compare_arrays, compare_outputs, worst
from kiln.core.onnx_io import ort_session

Model = onnx.ModelProto | Path
Samples = np.ndarray | dict[str, np.ndarray]  # one input's rows, or a feed of named inputs (same rows)
CHUNK = 256  # intermediate tensors made graph outputs per run (:func:`tensor_errors`): bounds the activations held


def n_rows(x: Samples) -> int:
    return len(next(iter(x.values()))) if isinstance(x, dict) else len(x)


def take_rows(x: Samples, index: Any) -> Samples:
    return {k: v[index] for k, v in x.items()} if isinstance(x, dict) else x[index]


def run_batched(
    model: Model, x: Samples, batch: int = 64, extra_outputs: list[str] | None = None, threads: int = 0
) -> list[np.ndarray]:
    """All outputs (the graph's outputs, then ``extra_outputs`` after its first when given) over ``x`` in
    batches of ``batch`` rows, or of the batch the graph fixes (the only one it takes), as float64."""
    if extra_outputs:
        model = _with_outputs(model, extra_outputs)
    sess = ort_session(model, threads=threads)
    feed = x if isinstance(x, dict) else {sess.get_inputs()[0].name: x}
    batch = _fixed_batch(sess) or batch
    parts: list[list[np.ndarray]] = []
    for i in range(0, n_rows(x), batch):
        parts.append(sess.run(None, {k: v[i : i + batch] for k, v in feed.items()}))
    # atleast_1d: an intermediate tensor may be a scalar (an attention scale); one value per batch then
    return [np.concatenate([np.atleast_1d(p[k]) for p in parts]).astype(np.float64) for k in range(len(parts[0]))]


def _fixed_batch(sess: Any) -> int | None:
    """The batch size every input of ``sess`` fixes on its first axis; None where one is dynamic or they differ."""
    first = {s[0] if s and isinstance(s[0], int) and s[0] >= 1 else None for s in (i.shape for i in sess.get_inputs())}
    return first.pop() if len(first) == 1 else None


def _with_outputs(model: Model, names: list[str]) -> onnx.ModelProto:
    m = onnx.load(str(model)) if isinstance(model, Path) else _copy(model)
    first = m.graph.output[0]
    del m.graph.output[1:]
    for n in names:
        if n != first.name:
            m.graph.output.append(onnx.ValueInfoProto(name=n))  # ORT infers the type
    return m


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    return m


def output_metrics(
    ref: np.ndarray | list[np.ndarray],
    got: np.ndarray | list[np.ndarray],
    logits: int | None = 0,
    where: np.ndarray | None = None,
) -> dict[str, float | None]:
    """The comparator's top-1 agreement (of output ``logits``, over the positions ``where`` marks; None: no class
    logits), cosine and max abs error (the worst output's) of ``got`` against ``ref``, with the sample count."""
    refs, gots = (ref, got) if isinstance(ref, list) else ([ref], [got])
    masks = {str(logits): where} if logits is not None and where is not None else None
    stats = compare_outputs(refs, gots, where=masks)
    top1 = stats[str(logits)].top1_agreement if logits is not None and str(logits) in stats else None
    return {
        "top1_agreement": top1,
        "cosine": worst(stats, "cosine"),
        "max_abs_err": worst(stats, "max_abs_err"),
        "samples": int(len(refs[0])),
    }


def rel_error(ref: np.ndarray, got: np.ndarray) -> float:
    """The comparator's relative L2 error (:func:`kiln.core.compare.compare_arrays`' ``rel_err``); inf when the
    shapes differ. The node-error curves take hundreds of these, so arrays of finite values below ``MASK_MIN``, where
    the comparator sets nothing aside (no NaN, infinity or mask fill), are measured directly, without its top-1,
    cosine and per-sample statistics; any other pair goes to the comparator."""
    if ref.shape != got.shape:
        return float("inf")
    r, g = np.asarray(ref, dtype=np.float64), np.asarray(got, dtype=np.float64)
    if not (np.isfinite(r).all() and np.isfinite(g).all() and (r.size == 0 or np.abs(r).max() < MASK_MIN)):
        return compare_arrays(ref, got).rel_err
    return float(np.linalg.norm(r - g) / (np.linalg.norm(r) + 1e-12))


def tensor_errors(
    ref_model: Model,
    model: Model,
    x: Samples,
    tensors: list[str],
    names: dict[str, str] | None = None,
    chunk: int = CHUNK,
) -> dict[str, float]:
    """Relative L2 error of each named intermediate tensor of ``model`` vs ``ref_model`` on ``x``, keyed by its name
    in ``ref_model``. ``names``: each tensor's counterpart in ``model`` (:func:`matching_tensors`), those without
    one left out; None: the tensor of the same name. Both graphs run once per ``chunk`` tensors, each chunk reduced
    to its errors before the next: only one chunk's activations are held at a time, not every tensor's."""
    ref_m, m = (onnx.load(str(p)) if isinstance(p, Path) else p for p in (ref_model, model))
    names = {t: t for t in tensors} if names is None else names
    # a tensor computed from weights alone is a weight: ONNX Runtime folds it into an initializer, which cannot be
    # made a graph output
    ours = _produced(ref_m) - _constant(ref_m) - {ref_m.graph.output[0].name}
    theirs = _produced(m) - _constant(m) - {m.graph.output[0].name}
    tensors = [t for t in tensors if t in ours and names.get(t) in theirs]  # e.g. one the cast clean-up merged
    err: dict[str, float] = {}
    for i in range(0, max(len(tensors), 1), chunk):
        err |= _chunk_errors(ref_m, m, x, tensors[i : i + chunk], names)
    return err


def _chunk_errors(
    ref_m: onnx.ModelProto, m: onnx.ModelProto, x: Samples, tensors: list[str], names: dict[str, str]
) -> dict[str, float]:
    """:func:`tensor_errors` of one chunk of ``tensors`` (with the graph output's, which every run computes)."""
    ref = run_batched(ref_m, x, extra_outputs=tensors)
    got = run_batched(m, x, extra_outputs=[names[t] for t in tensors])
    keys = [ref_m.graph.output[0].name, *tensors]
    return {t: rel_error(r, g) for t, r, g in zip(keys, ref, got)}


PASS_THROUGH = {"Cast", "QuantizeLinear", "DequantizeLinear"}  # store a value in another precision, same meaning


def computing_nodes(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    """Tensor -> the node that computes it, looking through Casts and Q/DQ pairs (:data:`PASS_THROUGH`)."""
    by_output = {o: n for n in model.graph.node for o in n.output}
    out: dict[str, onnx.NodeProto] = {}
    for tensor, node in by_output.items():
        seen = 0
        while node.op_type in PASS_THROUGH and node.input and node.input[0] in by_output and seen < 8:
            node, seen = by_output[node.input[0]], seen + 1
        out[tensor] = node
    return out


def producers(model: onnx.ModelProto) -> dict[str, str]:
    """Tensor -> the op that computes it, looking through Casts and Q/DQ pairs: an FP16 emulation's rounded tensor
    is its node's, an INT8 graph's dequantized one too, while a tensor a quantizer renamed (ONNX Runtime fuses a
    Relu into the Conv before it and gives the Conv the Relu's output name) has another op than FP32's."""
    return {t: n.op_type for t, n in computing_nodes(model).items()}


def matching_tensors(ref: onnx.ModelProto, model: onnx.ModelProto) -> dict[str, str]:
    """Each tensor of ``ref`` mapped to the tensor of ``model`` that holds its value. Mostly the same name, also
    where the variant computes it with other ops (a dynamically quantized Gemm ends in an Add that writes the
    Gemm's output); where a quantizer fused an op into its producer (ONNX Runtime: a Conv's Relu), the fused node
    keeps its name but writes the fused-in op's output name, which then holds the producer's value: that output is
    matched to the producer's own tensor (same node name and op, same output position). Tensors left out (the
    fused-in op's output, one the variant lacks) have no counterpart to compare with."""
    ours, theirs = computing_nodes(ref), computing_nodes(model)
    names = {n.name for n in ref.graph.node if n.name}

    def absorbed(t: str) -> bool:  # written by another node of ref's: t's own producer was fused into it
        mine, other = ours[t], theirs[t]
        return other.name in names and other.name != mine.name and other.op_type != mine.op_type

    match = {t: t for t in ours if t in theirs and not absorbed(t)}
    taken = set(match.values())
    by_name = {n.name: n for n in model.graph.node if n.name}
    for node in ref.graph.node:
        other = by_name.get(node.name)
        if other is None or other.op_type != node.op_type or len(other.output) != len(node.output):
            continue
        for mine, their in zip(node.output, other.output):
            if mine and mine not in match and their and their not in taken and theirs[their].op_type == node.op_type:
                match[mine] = their
                taken.add(their)
    return match


def _constant(model: onnx.ModelProto) -> set[str]:
    """Tensors computed from initializers and constants alone (in graph order, so transitively)."""
    const = {t.name for t in model.graph.initializer}
    for n in model.graph.node:
        if n.op_type == "Constant" or (n.input and all(i in const or not i for i in n.input)):
            const.update(n.output)
    return const


def _produced(model: onnx.ModelProto) -> set[str]:
    return {o for n in model.graph.node for o in n.output}
