"""Package stage: engines that passed validation, with metadata, laid out as a Triton model repository.

Triton layout: ``triton/<model>/config.pbtxt`` and ``triton/<model>/1/model.{onnx,plan}``.
"""
from __future__ import annotations

import json
import re
import shutil
from typing import Any

from kiln.core.errors import GateFailure
from kiln.core.stage import StageContext
from kiln.stages.engines.engines import SIDECAR, read_metadata

TRITON_TYPES = {"float32": "TYPE_FP32", "float16": "TYPE_FP16", "int64": "TYPE_INT64", "int32": "TYPE_INT32",
                "int8": "TYPE_INT8", "uint8": "TYPE_UINT8", "bool": "TYPE_BOOL", "float64": "TYPE_FP64"}
PLATFORMS = {"onnxruntime": ("onnxruntime_onnx", "model.onnx"), "tensorrt": ("tensorrt_plan", "model.plan")}


def _tensor_block(kind: str, specs: list[dict[str, Any]], batched: bool) -> str:
    items = []
    for s in specs:
        dims = [d if isinstance(d, int) and d > 0 else -1 for d in (s["shape"][1:] if batched else s["shape"])]
        items.append(f'  {{\n    name: "{s["name"]}"\n    data_type: {TRITON_TYPES[s["dtype"]]}\n'
                     f'    dims: [ {", ".join(map(str, dims))} ]\n  }}')
    return f"{kind} [\n" + ",\n".join(items) + "\n]\n"


def engine_max_batch(meta: dict[str, Any]) -> int | None:
    """The largest batch a TensorRT engine's optimization profiles accept (None: not bounded, e.g. ONNX Runtime)."""
    sizes = [shape["max"][0] for profile in meta.get("profiles") or [] for shape in profile.values()]
    return max(sizes) if sizes else None


def triton_config(model_name: str, meta: dict[str, Any], max_batch_size: int) -> str:
    platform, _ = PLATFORMS[meta["backend"]]
    limit = engine_max_batch(meta)
    if limit is not None and max_batch_size > limit:
        max_batch_size = limit  # Triton must not batch beyond what the engine's profiles were built for
    gpu = meta.get("device") == "cuda"
    batched = max_batch_size > 0
    text = f'name: "{model_name}"\nplatform: "{platform}"\nmax_batch_size: {max_batch_size}\n'
    text += _tensor_block("input", meta["inputs"], batched) + _tensor_block("output", meta["outputs"], batched)
    text += f"instance_group [ {{ kind: {'KIND_GPU' if gpu else 'KIND_CPU'} count: 1 }} ]\n"
    if batched:
        text += "dynamic_batching { }\n"
    return text


def run(ctx: StageContext) -> dict[str, Any]:
    cfg = ctx.config.package
    if not cfg.enabled:
        return {"status": "skipped", "models": []}
    validation = json.loads((ctx.inputs["validate"] / "validation.json").read_text())
    if validation.get("passed") is False:  # `kiln package` after a failed gate: keep the last good package
        raise GateFailure(f"validation failed ({'; '.join(validation.get('failures', [])) or 'see report.md'}): "
                          "nothing is packaged", hint="fix the engines, or relax validate.gates if the numbers are "
                                                      "acceptable, then `kiln run` again")
    results = {e["name"]: e for e in validation["engines"]}
    packaged = []
    for engine_dir in sorted(p.parent for p in ctx.inputs["build"].glob(f"*/{SIDECAR}")):
        meta = read_metadata(engine_dir)
        result = results.get(meta["name"], {})
        if result.get("passed") is not True or result.get("dropped"):
            continue  # only engines proven against PyTorch (and, with precision.require_speedup, faster) are served
        shutil.copytree(engine_dir, ctx.out / "engines" / meta["name"])
        record = {"engine": meta["name"], "validation": {k: result.get(k) for k in
                  ("max_abs_err", "cosine", "top1_agreement", "accuracy", "latency_ms")}}
        if cfg.triton and meta["backend"] in PLATFORMS:
            model_name = re.sub(r"[^A-Za-z0-9_]", "_", f"{ctx.config.name}_{meta['name']}")
            target = ctx.out / "triton" / model_name
            (target / "1").mkdir(parents=True)
            shutil.copy2(engine_dir / meta["files"]["model"], target / "1" / PLATFORMS[meta["backend"]][1])
            (target / "config.pbtxt").write_text(triton_config(model_name, meta, cfg.max_batch_size))
            record["triton_model"] = model_name
        packaged.append(record)
    (ctx.out / "kiln-package.json").write_text(json.dumps({"name": ctx.config.name, "models": packaged}, indent=2))
    return {"models": packaged}
