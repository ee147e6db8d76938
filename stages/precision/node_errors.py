"""Per-node error of each precision variant along the graph (relative L2 of every node's output vs the FP32
graph on the same samples), a plot of it, and the first node where each variant diverges: where to look first
when a variant misses its accuracy target (what Polygraphy's ``--onnx-outputs mark all`` prints, as a picture).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from kiln.core.artifacts import write_bytes_atomic
from kiln.stages.precision.compare import Model, Samples, producers, take_rows, tensor_errors
from kiln.stages.precision.fp16_select import INDEX_OPS

SAMPLES = 16  # every node output is held in memory at once: a few samples show where error starts
CHUNK = 256  # tensors compared per run: a large graph is run several times rather than holding them all
DIVERGENCE = 1e-2  # a node output 1% off FP32 (relative L2) counts as diverged
NAMED_NODES = 40  # a graph of at most this many nodes has their names under the axis, a larger one numbers
NAME_CHARS = 48  # a longer node name is cut to its last characters under the axis
NAME_INCH = 0.05  # the length of one character of a name at the ticks' 6 pt, in inches (DejaVu Sans, with room)


def graph_order(fp32: onnx.ModelProto) -> list[tuple[str, str]]:
    """``(node name, its first float output)`` along the graph, index ops (shapes, sizes) left out."""
    floats = {
        v.name
        for v in [*fp32.graph.value_info, *fp32.graph.output]
        if v.type.tensor_type.elem_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)
    }
    return [
        (n.name, next(o for o in n.output if o in floats))
        for n in fp32.graph.node
        if n.op_type not in INDEX_OPS | {"Constant"} and any(o in floats for o in n.output)
    ]


def node_error_curves(fp32: onnx.ModelProto, variants: dict[str, Model], x: Samples) -> dict[str, list[float]]:
    """For each variant, the error of each node of :func:`graph_order` (NaN where the variant has no such
    tensor, or one another op computes: a node the INT8 rewrite replaced or fused); the graph output's error is the
    variant's last entry."""
    order = graph_order(fp32)
    out_name = fp32.graph.output[0].name
    tensors = [t for _, t in order if t != out_name]
    ours = producers(fp32)
    curves: dict[str, list[float]] = {}
    for label, model in variants.items():
        theirs = producers(
            model if isinstance(model, onnx.ModelProto) else onnx.load(str(model), load_external_data=False)
        )
        same = [t for t in tensors if theirs.get(t) == ours.get(t)]  # a name alone may mean another value
        err: dict[str, float] = {}
        for i in range(0, max(len(same), 1), CHUNK):  # a bounded number of activations in memory at once
            err |= tensor_errors(fp32, model, take_rows(x, slice(0, SAMPLES)), same[i : i + CHUNK])
        curves[label] = [err.get(t, float("nan")) for _, t in order]
    return curves


def first_divergence(
    order: list[tuple[str, str]], curve: list[float], threshold: float = DIVERGENCE
) -> dict[str, Any] | None:
    for (node, _), err in zip(order, curve):
        if not math.isnan(err) and err > threshold:
            return {"node": node, "error": err}
    return None


def _tick_name(node: str) -> str:
    """A node's name as a tick label: a long one keeps its end (the op and layer), which tells nodes apart."""
    return node if len(node) <= NAME_CHARS else "…" + node[-(NAME_CHARS - 1) :]


def plot_node_errors(
    order: list[tuple[str, str]], curves: dict[str, list[float]], path: Path, kept: dict[str, set[str]] | None = None
) -> Path:
    """A log-scale line per variant along the graph, FP32-kept nodes marked, the divergence threshold drawn."""
    import io

    from matplotlib.backends.backend_agg import FigureCanvasAgg  # files only, no display, no pyplot state
    from matplotlib.figure import Figure

    names = [_tick_name(n) for n, _ in order] if len(order) <= NAMED_NODES else []
    # node names under the axis: the figure grows by their length, leaving the plot its height
    below = NAME_INCH * max(map(len, names), default=0)
    fig = Figure(figsize=(min(4 + 0.12 * len(order), 16), 4.5 + below))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    xs = np.arange(len(order))
    floor = 1e-8  # exact nodes (error 0) still show, at the bottom
    for label, curve in curves.items():
        ys = np.array([max(e, floor) if np.isfinite(e) else np.nan for e in curve])
        (line,) = ax.plot(xs, ys, marker=".", lw=1, label=label)
        marks = [i for i, (node, _) in enumerate(order) if node in (kept or {}).get(label, set())]
        if marks:
            ax.scatter(marks, ys[marks], marker="s", facecolors="none", edgecolors=line.get_color(), s=36)
    ax.axhline(DIVERGENCE, color="grey", ls="--", lw=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("node, in graph order (squares: kept in FP32)")
    ax.set_ylabel("relative L2 error vs FP32")
    ax.set_title("Per-node error of each precision variant")
    ax.legend(fontsize=8)
    if names:  # else the node numbers matplotlib picks
        ax.set_xticks(xs, names, rotation=90, fontsize=6)
    # fixed margins, in inches: fitting them (tight_layout) measures every label's text, most of the render's time
    width, height = fig.get_size_inches()
    fig.subplots_adjust(left=0.9 / width, right=1 - 0.1 / width, bottom=(0.55 + below) / height, top=1 - 0.4 / height)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, metadata={"Software": None})  # same curves, same bytes
    write_bytes_atomic(path, buf.getvalue())
    return path
