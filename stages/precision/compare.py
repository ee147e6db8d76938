"""Comparing a reduced-precision graph with the FP32 one: output agreement, and per-tensor errors to find
the nodes that introduce the difference (like Polygraphy's ``--onnx-outputs mark all`` comparison)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from kiln.core.compare import compare_arrays
from kiln.core.onnx_io import ort_session

Model = onnx.ModelProto | Path


def run_batched(model: Model, x: np.ndarray, batch: int = 64, extra_outputs: list[str] | None = None,
                threads: int = 0) -> list[np.ndarray]:
    """All outputs (the graph's first, then ``extra_outputs``) over ``x`` in batches, as float64."""
    if extra_outputs:
        model = _with_outputs(model, extra_outputs)
    sess = ort_session(model, threads=threads)
    name = sess.get_inputs()[0].name
    parts: list[list[np.ndarray]] = []
    for i in range(0, len(x), batch):
        parts.append(sess.run(None, {name: x[i:i + batch]}))
    return [np.concatenate([p[k] for p in parts]).astype(np.float64) for k in range(len(parts[0]))]


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


def output_metrics(ref: np.ndarray, got: np.ndarray) -> dict[str, float | None]:
    """The comparator's top-1 agreement, cosine and max abs error of ``got`` against ``ref``, with the sample count."""
    stats = compare_arrays(ref, got)
    return {"top1_agreement": stats.top1_agreement, "cosine": stats.cosine, "max_abs_err": stats.max_abs_err,
            "samples": int(len(ref))}


def rel_error(ref: np.ndarray, got: np.ndarray) -> float:
    """The comparator's relative L2 error; inf when the shapes differ."""
    return compare_arrays(ref, got).rel_err if ref.shape == got.shape else float("inf")


def tensor_errors(ref_model: Model, model: Model, x: np.ndarray, tensors: list[str]) -> dict[str, float]:
    """Relative L2 error of each named intermediate tensor of ``model`` vs ``ref_model`` on ``x``."""
    ref_m, m = (onnx.load(str(p)) if isinstance(p, Path) else p for p in (ref_model, model))
    common = _produced(ref_m) & _produced(m) - {ref_m.graph.output[0].name}
    tensors = [t for t in tensors if t in common]  # e.g. a tensor the cast clean-up merged away
    ref = run_batched(ref_m, x, extra_outputs=tensors)
    got = run_batched(m, x, extra_outputs=tensors)
    names = [ref_m.graph.output[0].name, *tensors]
    return {t: rel_error(r, g) for t, r, g in zip(names, ref, got)}


def _produced(model: onnx.ModelProto) -> set[str]:
    return {o for n in model.graph.node for o in n.output}
