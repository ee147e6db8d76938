"""Package stage: engines that passed validation, with metadata, laid out as Triton model repositories.

``triton/<model>/``: the stock backend (``onnxruntime_onnx`` / ``tensorrt_plan``) for engines it can express;
``triton-python/<model>/``: Triton's Python backend running the Kiln engine itself, for every engine (see
:mod:`kiln.stages.triton_repo`). ``kiln serve`` serves ``engines/`` directly through PyTriton.
"""
from __future__ import annotations

import json
import re
import shutil
from typing import Any

from kiln.core.errors import GateFailure
from kiln.core.stage import StageContext
from kiln.stages.engines.engines import SIDECAR, read_metadata
from kiln.stages.triton_repo import PLATFORMS, engine_max_batch, triton_config, write_python_model, write_stock_model

__all__ = ["engine_max_batch", "run", "triton_config", "triton_model_name"]


def triton_model_name(config_name: str, engine_name: str) -> str:
    """Triton model names: letters, digits and underscores (the repository folder's name)."""
    return re.sub(r"[^A-Za-z0-9_]", "_", f"{config_name}_{engine_name}")


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
        if result.get("passed") is not True:
            continue  # only engines proven against PyTorch are served
        packaged_dir = ctx.out / "engines" / meta["name"]
        shutil.copytree(engine_dir, packaged_dir)
        record = {"engine": meta["name"], "validation": {k: result.get(k) for k in
                  ("max_abs_err", "cosine", "top1_agreement", "accuracy", "latency_ms")}}
        model_name = triton_model_name(ctx.config.name, meta["name"])
        # Stock backends cannot run TensorRT-RTX engines (flavour "tensorrt_rtx") nor keep ORT's autotuned settings.
        if cfg.triton and meta["backend"] in PLATFORMS and meta.get("flavour") != "tensorrt_rtx":
            write_stock_model(ctx.out / "triton" / model_name, packaged_dir, meta, cfg.max_batch_size)
            record["triton_model"] = model_name
        if cfg.triton_python:
            write_python_model(ctx.out / "triton-python" / model_name, packaged_dir, meta, cfg.max_batch_size)
            record["triton_python_model"] = model_name
        packaged.append(record)
    (ctx.out / "kiln-package.json").write_text(json.dumps({"name": ctx.config.name, "models": packaged}, indent=2))
    return {"models": packaged}
