"""Pipeline entry of the optimize stage: export/model.onnx -> optimize/model.onnx plus a per-pass summary."""

from __future__ import annotations

from typing import Any

import kiln.stages.optimize
from kiln.core.env import environment_subset
from kiln.core.onnx_io import check_onnx, load_onnx, save_onnx
from kiln.core.stage import Stage, StageContext
from kiln.stages.export import read_dynamic_sizes, read_int_ranges
from kiln.stages.optimize.api import optimize_model


def run(ctx: StageContext) -> dict[str, Any]:
    model = load_onnx(ctx.inputs["export"] / "model.onnx")
    out, summary = optimize_model(
        model, ctx.config.optimize, read_dynamic_sizes(ctx.inputs["export"]), read_int_ranges(ctx.inputs["export"])
    )
    path = ctx.out / "model.onnx"
    save_onnx(out, path)
    check_onnx(path, "optimized model")
    if summary["rolled_back"]:
        ctx.log.warning("optimize: passes rolled back (changed the outputs): %s", ", ".join(summary["rolled_back"]))
    ctx.log.info(
        "optimize: %d -> %d nodes in %.2fs", summary["nodes_before"], summary["nodes_after"], summary["seconds"]
    )
    return summary


def report_section(summary: dict[str, Any]) -> list[str]:
    """Graph optimization's part of report.md: node counts and the passes that fired or were rolled back."""
    out: list[str] = []
    opt = summary
    if "nodes_before" in opt:
        fired = [p["name"] for p in opt.get("passes", []) if p.get("nodes_before") != p.get("nodes_after")]
        out += [
            "",
            "## Graph optimization",
            "",
            f"{opt['nodes_before']} -> {opt['nodes_after']} nodes; passes that changed the graph: "
            f"{', '.join(dict.fromkeys(fired)) or 'none'}; "
            f"rolled back: {', '.join(opt.get('rolled_back', [])) or 'none'}.",
        ]
    return out


def _env(cfg: Any) -> dict[str, Any]:
    return environment_subset("onnx", "onnx-graphsurgeon", "onnxruntime")


STAGE = Stage(
    "optimize",
    run,
    ("export",),
    ("optimize",),
    (kiln.stages.optimize,),
    _env,
    "graph passes with onnx-graphsurgeon",
    report=report_section,
)
