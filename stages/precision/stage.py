"""Pipeline entry of the precision stage: one graph per configured precision, listed in variants.json.

variants.json is a :class:`kiln.core.records.Variants`: per precision its graph (``path``, or a graph made for one
engine kind in ``backend_paths``), the nodes kept FP32 and why, its agreement with FP32, and the stage's own
diagnostics (``report``).
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import kiln.calibration
import kiln.stages.precision
import numpy as np
from kiln.calibration.data import calibration_batches
from kiln.core.env import environment_subset
from kiln.core.onnx_io import load_onnx
from kiln.core.records import PrecisionVariant, Variants
from kiln.core.stage import Stage, StageContext
from kiln.core.text import fmt
from kiln.stages.precision.variants import Source, build_fp16, build_int8


def run(ctx: StageContext) -> dict[str, Any]:
    cfg, ccfg = ctx.config.precision, ctx.config.calibration
    wanted = list(dict.fromkeys(cfg.variants))
    data = ctx.dataset()
    needs_data = "int8" in wanted or ("fp16" in wanted and cfg.fp16.range_check)
    batches = calibration_batches(data, ccfg, ctx.config.seed) if needs_data else []
    x_val = data.val_x[:cfg.fallback.samples].numpy()
    variants: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kiln-precision-") as tmp:
        # The FP32 variant is the optimized graph with every node named and shapes inferred: the names are
        # how kept nodes are reported, and the same file is what calibration hashes for its cache key.
        fp32_path = ctx.out / "fp32" / "model.onnx" if "fp32" in wanted else Path(tmp) / "fp32.onnx"
        src = Source.prepare(load_onnx(ctx.inputs["optimize"] / "model.onnx"), fp32_path, batches,
                             ctx.cache_dir if ccfg.cache else Path(tmp))  # no cache: ranges live only this run
        cache_dir = src.cache_dir if ccfg.cache else None
        with ctx.progress.task("precision variants", total=len(wanted)) as bar:
            for precision in wanted:
                out = ctx.out / precision / "model.onnx"
                if precision == "fp32":
                    variants["fp32"] = {"path": "fp32/model.onnx", "kept_fp32": [], "reasons": {}}
                elif precision == "fp16":
                    variants["fp16"] = build_fp16(src, out, cfg.fp16, cfg.fallback, x_val, ccfg)
                else:
                    variants["int8"] = build_int8(src, out, ccfg, cfg.fallback, x_val)
                bar.advance(1, note=precision)
                _log_variant(ctx, precision, variants[precision])
    records = {name: _record(entry) for name, entry in variants.items()}
    Variants(variants=records).write(ctx.out / "variants.json")
    summary = {v: {"kept_fp32": len(e.kept_fp32), "kept_fp32_nodes": e.reasons, **(e.vs_fp32 or {}),
                   "fallback_passed": e.fallback_passed,
                   **({"ort_cpu_scheme": e.report["ort_cpu"]["scheme"]} if "ort_cpu" in e.report else {})}
               for v, e in records.items()}
    return {"variants": summary, "calibration_cache": str(cache_dir / "calibration") if cache_dir else None}


def _log_variant(ctx: StageContext, precision: str, entry: dict[str, Any]) -> None:
    vs = entry.get("vs_fp32") or {}
    if vs:
        ctx.log.info("%s: top-1 agreement vs FP32 %.4f, %d nodes kept FP32", precision, vs["top1_agreement"],
                     len(entry["kept_fp32"]))
    if not entry.get("fallback", {}).get("passed", True):
        ctx.log.warning("%s misses precision.fallback targets after %d rounds; validation gates decide",
                        precision, len(entry["fallback"]["rounds"]) - 1)


def _record(entry: dict[str, Any]) -> PrecisionVariant:
    """A variant's entry as the typed record; what only people read goes into ``report`` as plain JSON."""
    typed = {"path", "kept_fp32", "reasons", "backend_paths", "vs_fp32"}
    report = json.loads(json.dumps({k: v for k, v in entry.items() if k not in typed}, default=_jsonable))
    return PrecisionVariant(**{k: v for k, v in entry.items() if k in typed},
                            fallback_passed=entry.get("fallback", {}).get("passed", True), report=report)


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    return str(obj)


def report_section(summary: dict[str, Any]) -> list[str]:
    """The precision variants' part of report.md: nodes kept FP32 and agreement with the FP32 graph."""
    out: list[str] = []
    variants = summary.get("variants", {})
    if variants:
        out += ["", "## Precision variants", "", "| variant | nodes kept in FP32 | top-1 agreement vs FP32 graph |", "|---|---|---|"]
        out += [f"| {name} | {v.get('kept_fp32', 0)} | {fmt(v.get('top1_agreement'))} |" for name, v in variants.items()]
        for name, v in variants.items():
            if "ort_cpu_scheme" in v:
                out += ["", f"ONNX Runtime CPU engines of `{name}` load a graph of their own, quantized "
                            f"**{v['ort_cpu_scheme']}** (`calibration.ort_cpu_scheme`)."]
        kept = [(name, node, why) for name, v in variants.items() for node, why in v.get("kept_fp32_nodes", {}).items()]
        if kept:
            out += ["", "Nodes kept in FP32:", ""] + [f"- {name}: `{node}`: {why}" for name, node, why in kept[:40]]
            out += [f"- ... and {len(kept) - 40} more (see precision/variants.json)"] if len(kept) > 40 else []
    return out


def _env(cfg: Any) -> dict[str, Any]:
    return environment_subset("onnx", "onnx-graphsurgeon", "onnxruntime")


STAGE = Stage("precision", run, ("optimize", "train"), ("seed", "model.name", "data", "precision", "calibration"),
              (kiln.stages.precision, kiln.calibration), _env, "FP16 mixed precision and INT8 (Q/DQ) graphs",
              data=("dataset", "calibration"), report=report_section)
