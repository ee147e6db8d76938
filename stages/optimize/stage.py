"""Pipeline entry of the optimize stage: export/model.onnx -> optimize/model.onnx plus a per-pass summary."""

from __future__ import annotations

from kiln.core.onnx_io import check_onnx, load_onnx, save_onnx
from kiln.core.stage import StageContext
from kiln.stages.export.declaration import read_dynamic_sizes, read_int_ranges
from kiln.stages.optimize.api import optimize_model
from kiln.stages.optimize.declaration import OptimizeSettings, OptimizeSummary

__all__ = ["OptimizeSettings", "OptimizeSummary", "run"]


def run(ctx: StageContext[OptimizeSettings]) -> OptimizeSummary:
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
    return OptimizeSummary.model_validate(summary)
