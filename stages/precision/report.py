"""The precision variants' section of report.md: nodes kept FP32 (with the PyTorch module each came from), each
variant's agreement with the FP32 graph, failed variants, and the per-node error plot."""

from __future__ import annotations

import math
from typing import Any

from kiln.core.text import fmt


def report_section(precision: Any) -> list[str]:
    """``precision``: the stage's ``PrecisionSummary``."""
    out: list[str] = []
    variants = precision.variants
    if variants:
        out += [
            "",
            "## Precision variants",
            "",
            "| variant | nodes kept in FP32 | top-1 agreement vs FP32 graph |",
            "|---|---|---|",
        ]
        out += [
            f"| {_label(name, v)} | {v.get('kept_fp32', 0)} | {fmt(v.get('top1_agreement'))} |"
            for name, v in variants.items()
        ]
        out += [f"| {name} | **failed, not built** | - |" for name in precision.failed]
        out += [line for name, v in variants.items() for line in _unmade(name, v)]
        for name, v in variants.items():
            if v.get("graph"):
                out += ["", f"`{name}`: {v['graph']}."]
            if "ort_cpu_scheme" in v and not v.get("ort_cpu_unmade"):
                out += [
                    "",
                    f"ONNX Runtime CPU engines of `{name}` load a graph of their own, quantized "
                    f"**{v['ort_cpu_scheme']}** (`calibration.ort_cpu_scheme`), checked on its own: top-1 "
                    f"agreement {fmt(v.get('ort_cpu_top1_agreement'))} with {v.get('ort_cpu_kept_fp32', 0)} "
                    "nodes kept in float.",
                ]
            if v.get("reduce_range"):
                out += [
                    "",
                    f"`{name}` weights are quantized to 7 bits (`calibration.reduce_range`): safe from the "
                    "16-bit saturation of ONNX Runtime's fast INT8 kernels on x86 CPUs without VNNI, in any "
                    "runtime.",
                ]
        out += [f"- **{name} failed**: {why}" for name, why in precision.failed.items()]
        out += _kept_nodes_table(variants)
        if precision.node_error_plot:
            out += ["", f"![per-node error vs FP32](precision/{precision.node_error_plot})", ""]
            out += [
                f"- {name}: first node over {precision.node_error_threshold:g} relative error: "
                + (
                    f"`{hit['node']}` ({hit.get('module') or 'module unknown'}), {_error(hit['error'])}"
                    if hit
                    else "none"
                )
                for name, hit in (precision.first_divergence or {}).items()
            ]
    return out


def _label(name: str, v: dict[str, Any]) -> str:
    """A variant's name in the table, marked where its Q/DQ graph was not made: a row whose numbers are those of a
    graph that missed the gates must not read as a variant that engines are built from."""
    if not v.get("unmade"):
        return name
    only = ", ".join(v.get("backend_paths") or {})
    return f"{name} (**Q/DQ graph not made**; only for {only})" if only else f"{name} (**not made**)"


def _unmade(name: str, v: dict[str, Any]) -> list[str]:
    """Why a variant's Q/DQ graph (or ONNX Runtime CPU's own graph) was not made, and which engines that leaves: the
    torch backend's are said only for a run with a PyTorch model (``pytorch_model``), the one they compile from."""
    out = []
    if v.get("unmade"):
        only = ", ".join(v.get("backend_paths") or {})
        torch = "; those the torch backend compiles from the PyTorch model (where build.backends lists it) still are"
        left = (
            f"engines that build from it (TensorRT's) are not built; {only} engines load their own graph, which passed"
            if only
            else "no engine is built from its graph" + (torch if v.get("pytorch_model") else "")
        )
        out += ["", f"- **{name}**: {v['unmade']}; {left}."]
    if v.get("ort_cpu_unmade"):
        out += ["", f"- `{name}`: {v['ort_cpu_unmade']}; ONNX Runtime CPU engines load the Q/DQ graph instead."]
    return out


def _error(value: float | None) -> str:
    """A relative error as the report writes it; JSON holds a non-finite one as null."""
    return "not finite" if value is None or not math.isfinite(value) else f"{value:.3g}"


def _kept_nodes_table(variants: dict[str, Any], limit: int = 40) -> list[str]:
    """Each node kept in FP32 (or float, for INT8), with the PyTorch module the exporter recorded for it."""
    rows = []
    for name, v in variants.items():
        for label, nodes, modules in (
            (name, v.get("kept_fp32_nodes", {}), v.get("kept_fp32_modules", {})),
            (f"{name} onnxruntime-cpu", v.get("ort_cpu_kept_fp32_nodes", {}), v.get("ort_cpu_kept_fp32_modules", {})),
        ):
            rows += [f"| {label} | `{node}` | {modules.get(node, '-')} | {why} |" for node, why in nodes.items()]
    if not rows:
        return []
    more = ["", f"... and {len(rows) - limit} more (see precision/variants.json)"] if len(rows) > limit else []
    return [
        "",
        "Nodes kept in FP32:",
        "",
        "| variant | ONNX node | PyTorch module | why |",
        "|---|---|---|---|",
        *rows[:limit],
        *more,
    ]
