"""Comparing a reduced-precision graph with the FP32 one: output agreement, and per-tensor errors to find
the nodes that introduce the difference (like Polygraphy's ``--onnx-outputs mark all`` comparison)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx

from kiln.core.compare import compare_arrays, compare_outputs, worst
from kiln.core.onnx_io import ort_session

Model = onnx.ModelProto | Path
Samples = np.ndarray | dict[str, np.ndarray]  # one input's rows, or a feed of named inputs (same rows)


def n_rows(x: Samples) -> int:
    return len(next(iter(x.values()))) if isinstance(x, dict) else len(x)


def take_rows(x: Samples, index: Any) -> Samples:
    return {k: v[index] for k, v in x.items()} if isinstance(x, dict) else x[index]


def run_batched(
    model: Model, x: Samples, batch: int = 64, extra_outputs: list[str] | None = None, threads: int = 0
) -> list[np.ndarray]:
    """All outputs (the graph's outputs, then ``extra_outputs`` after its first when given) over ``x`` in
    batches, as float64."""
    if extra_outputs:
        model = _with_outputs(model, extra_outputs)
    sess = ort_session(model, threads=threads)
    feed = x if isinstance(x, dict) else {sess.get_inputs()[0].name: x}
    parts: list[list[np.ndarray]] = []
    for i in range(0, n_rows(x), batch):
        parts.append(sess.run(None, {k: v[i : i + batch] for k, v in feed.items()}))
    # atleast_1d: an intermediate tensor may be a scalar (an attention scale); one value per batch then
    return [np.concatenate([np.atleast_1d(p[k]) for p in parts]).astype(np.float64) for k in range(len(parts[0]))]


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
    """The comparator's relative L2 error; inf when the shapes differ."""
    return compare_arrays(ref, got).rel_err if ref.shape == got.shape else float("inf")


def tensor_errors(ref_model: Model, model: Model, x: Samples, tensors: list[str]) -> dict[str, float]:
    """Relative L2 error of each named intermediate tensor of ``model`` vs ``ref_model`` on ``x``."""
    ref_m, m = (onnx.load(str(p)) if isinstance(p, Path) else p for p in (ref_model, model))
    # a tensor computed from weights alone is a weight: ONNX Runtime folds it into an initializer, which cannot be
    # made a graph output
    common = _produced(ref_m) & _produced(m) - {ref_m.graph.output[0].name} - _constant(ref_m) - _constant(m)
    tensors = [t for t in tensors if t in common]  # e.g. a tensor the cast clean-up merged away
    ref = run_batched(ref_m, x, extra_outputs=tensors)
    got = run_batched(m, x, extra_outputs=tensors)
    names = [ref_m.graph.output[0].name, *tensors]
    return {t: rel_error(r, g) for t, r, g in zip(names, ref, got)}


def _constant(model: onnx.ModelProto) -> set[str]:
    """Tensors computed from initializers and constants alone (in graph order, so transitively)."""
    const = {t.name for t in model.graph.initializer}
    for n in model.graph.node:
        if n.op_type == "Constant" or (n.input and all(i in const or not i for i in n.input)):
            const.update(n.output)
    return const


def _produced(model: onnx.ModelProto) -> set[str]:
    return {o for n in model.graph.node for o in n.output}
