"""Pipeline entry of the optimize stage."""
from __future__ import annotations

import time
from typing import Any

import onnx
import onnx_graphsurgeon as gs

from pipeline.onnx_io import check_onnx, load_onnx, save_onnx
from pipeline.stage import StageContext
from stages.optimize.config import OptimizeConfig


def optimize_model(model: onnx.ModelProto, cfg: OptimizeConfig) -> tuple[onnx.ModelProto, dict[str, Any]]:
    t0 = time.perf_counter()
    before = len(model.graph.node)
    graph = gs.import_onnx(model)
    graph.fold_constants().cleanup().toposort()
    out = gs.export_onnx(graph)
    out.ir_version = model.ir_version
    check_onnx(out, "optimized model")
    return out, {"nodes_before": before, "nodes_after": len(out.graph.node), "seconds": time.perf_counter() - t0}


def run(ctx: StageContext) -> dict[str, Any]:
    model = load_onnx(ctx.inputs["export"] / "model.onnx")
    out, report = optimize_model(model, ctx.config.optimize)
    save_onnx(out, ctx.out / "model.onnx")
    return report
