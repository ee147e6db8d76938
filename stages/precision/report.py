"""The precision variants' section of report.md: nodes kept FP32 (with the PyTorch module each came from), each
variant's agreement with the FP32 graph (top-1 agreement where an output is class logits, a multi-label head's
decision agreement, else cosine and relative error), failed variants, and the per-node error plot."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

from kiln.core.text import fmt


def report_section(precision: Any) -> list[str]:
    """``precision``: the stage's ``PrecisionSummary``."""
    out: list[str] = []
    variants = precision.variants
    if variants:
        logits = class_logits(variants)
        columns = _columns(variants, logits)
        out += [
            "",
            "## Precision variants",
            "",
            f"| variant | nodes kept in FP32 | {' | '.join(head for head, _ in columns)} |",
            "|---|---|" + "---|" * len(columns),
        ]
        out += [
            f"| {_label(name, v)} | {v.get('kept_fp32', 0)} | {' | '.join(cell(v) for _, cell in columns)} |"
            for name, v in variants.items()
        ]
        out += [f"| {name} | **failed, not built** | {' | '.join('-' for _ in columns)} |" for name in precision.failed]
        if not logits and judged(variants):
            out += ["", NO_LOGITS_NOTE]
        out += [line for name, v in variants.items() for line in _unmade(name, v)]
        for name, v in variants.items():
            if v.get("graph"):
                out += ["", f"`{name}`: {v['graph']}."]
            if v.get("float_tables"):
                out += ["", f"`{name}`: {v['float_tables']}."]
            if "ort_cpu_scheme" in v and not v.get("ort_cpu_unmade"):
                out += [
                    "",
                    f"ONNX Runtime CPU engines of `{name}` load a graph of their own, quantized "
                    f"**{v['ort_cpu_scheme']}** (`calibration.ort_cpu_scheme`), checked on its own: "
                    f"{vs_fp32_text(_ort_cpu_figures(v), logits)} with {v.get('ort_cpu_kept_fp32', 0)} nodes kept "
                    "in float.",
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


NO_LOGITS_NOTE = (
    "No output is class logits: each variant is compared with the FP32 graph on the held-out data by the cosine of "
    "its outputs (the worst sample's, where measured) and their relative error (where recorded), the figures its "
    "gates judge."
)


def class_logits(variants: dict[str, dict[str, Any]]) -> bool:
    """Whether the variants were judged by a top-1 agreement with the FP32 graph (an output is class logits, or every
    output is integers): some variant records one."""
    return _records(variants, "top1_agreement")


# The figures a variant's check against the FP32 graph records (vs_fp32_text says them)
FIGURES = ("top1_agreement", "cosine", "sample_cosine", "rel_err")


def judged(variants: dict[str, dict[str, Any]]) -> bool:
    """Whether some variant records a figure of its check against the FP32 graph (:data:`FIGURES`). Only then does
    the absence of a top-1 agreement say that no output is class logits: where every variant but FP32 failed, none
    records one whatever the outputs are."""
    return any(_records(variants, key) for key in FIGURES)


def _columns(variants: dict[str, dict[str, Any]], logits: bool) -> list[tuple[str, Callable[[dict[str, Any]], str]]]:
    """The table's figures of each variant against the FP32 graph, as (header, cell): top-1 agreement where the
    variants were judged by one (:func:`class_logits`), else the worst sample's cosine (the whole output's where no
    variant records a sample's) and the relative error (where one is recorded)."""
    if logits:
        return [(f"{agreement_word(variants.values())} vs FP32 graph", lambda v: fmt(v.get("top1_agreement")))]
    key = "sample_cosine" if _records(variants, "sample_cosine") else "cosine"
    head = "worst-sample cosine vs FP32 graph" if key == "sample_cosine" else "cosine vs FP32 graph"
    columns = [(head, lambda v: fmt(v.get(key), ".6f"))]
    if _records(variants, "rel_err"):
        columns.append(("relative error vs FP32 graph", lambda v: _rel(v.get("rel_err"))))
    return columns


def agreement_word(records: Iterable[dict[str, Any]]) -> str:
    """What the class logits' agreement counted, as validation's report heads it: a multi-label head's
    ``top1_agreement`` is its decision agreement (a record's ``agreement``: ``"decision"``), else top-1."""
    return "decision agreement" if any(r.get("agreement") == "decision" for r in records) else "top-1 agreement"


def _records(variants: dict[str, dict[str, Any]], key: str) -> bool:
    """Whether some variant records ``key`` (a figure of its check, :func:`_columns`)."""
    return any(v.get(key) is not None for v in variants.values())


def vs_fp32_text(vs: dict[str, Any], logits: bool | None = None) -> str:
    """What a variant's check against the FP32 graph measured (``vs``: its ``vs_fp32``), in words: its top-1 agreement
    where it was judged by one (``logits``; None: where ``vs`` records one), and those of its cosine, worst sample's
    cosine and relative error it records (the cosine always where it has no top-1 agreement)."""
    said = []
    if logits or (logits is None and vs.get("top1_agreement") is not None):
        said.append(f"{agreement_word([vs])} {fmt(vs.get('top1_agreement'))}")
    if vs.get("cosine") is not None or not said:
        said.append(f"cosine {fmt(vs.get('cosine'), '.6f')}")
    if vs.get("sample_cosine") is not None:
        said.append(f"worst-sample cosine {fmt(vs['sample_cosine'], '.6f')}")
    if vs.get("rel_err") is not None:
        said.append(f"relative error {_rel(vs['rel_err'])}")
    return ", ".join(said)


def _ort_cpu_figures(v: dict[str, Any]) -> dict[str, Any]:
    """The ONNX Runtime CPU graph's own check against the FP32 graph, as :func:`vs_fp32_text` reads one."""
    keys = ("top1_agreement", "cosine", "sample_cosine", "rel_err")
    return {"agreement": v.get("ort_cpu_agreement", v.get("agreement")), **{k: v.get(f"ort_cpu_{k}") for k in keys}}


def _rel(value: float | None) -> str:
    """A relative error as the table writes it: ``-`` where none was measured."""
    return "-" if value is None else _error(value)


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
        out += ["", f"- `{name}`: {v['ort_cpu_unmade']}; {ort_cpu_left(v)}."]
    return out


def ort_cpu_left(v: dict[str, Any]) -> str:
    """What ONNX Runtime CPU engines of a variant whose own CPU graph was not made load: its Q/DQ graph where that
    was made; where it was not (``unmade``), nothing in that precision, said as such, not as a graph they load
    instead. ``v``: the summary's entry (``fallback_passed``) or the stage's own (``fallback``); the Q/DQ graph is
    said to have missed its gates only where its fallback did not pass (else it had too little in the precision)."""
    if not v.get("unmade"):
        return "ONNX Runtime CPU engines load the Q/DQ graph instead"
    passed = v.get("fallback_passed", (v.get("fallback") or {}).get("passed", True))
    why = "missed its gates too" if passed is False else "was not made either"
    return f"its Q/DQ graph {why}, so no ONNX Runtime CPU engine is built in this precision"


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
