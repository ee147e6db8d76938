"""Package stage: engines that passed validation, with metadata, laid out as a Triton model repository.

Triton layout: ``triton/<model>/config.pbtxt`` and ``triton/<model>/1/model.{onnx,plan}``.
"""
from __future__ import annotations

import json
import re
import shutil
import sys
from typing import Any

from kiln.core.errors import GateFailure
from kiln.core.records import EngineMetadata, TensorSpec, ValidationResult
from kiln.core.sections import Section
from kiln.core.stage import Stage, StageContext
from kiln.stages.engines.engines import engine_dirs, read_metadata
from kiln.stages.engines.registry import BACKENDS
from pydantic import Field

TRITON_TYPES = {"float32": "TYPE_FP32", "float16": "TYPE_FP16", "int64": "TYPE_INT64", "int32": "TYPE_INT32",
                "int8": "TYPE_INT8", "uint8": "TYPE_UINT8", "bool": "TYPE_BOOL", "float64": "TYPE_FP64"}

class PackageConfig(Section):
    enabled: bool = True
    triton: bool = Field(True, description="write a Triton model repository")
    max_batch_size: int = Field(32, ge=0)


def _tensor_block(kind: str, specs: list[TensorSpec], batched: bool) -> str:
    items = []
    for s in specs:
        dims = [d if isinstance(d, int) and d > 0 else -1 for d in (s.shape[1:] if batched else s.shape)]
        items.append(f'  {{\n    name: "{s.name}"\n    data_type: {TRITON_TYPES[s.dtype]}\n'
                     f'    dims: [ {", ".join(map(str, dims))} ]\n  }}')
    return f"{kind} [\n" + ",\n".join(items) + "\n]\n"


def triton_config(model_name: str, meta: EngineMetadata, max_batch_size: int) -> str:
    triton = BACKENDS[meta.backend].triton
    assert triton is not None, f"{meta.backend} engines have no stock Triton backend"
    limit = meta.max_batch()
    if limit is not None and max_batch_size > limit:
        max_batch_size = limit  # Triton must not batch beyond what the engine's profiles were built for
    gpu = meta.device == "cuda"
    batched = max_batch_size > 0
    text = f'name: "{model_name}"\nplatform: "{triton.platform}"\nmax_batch_size: {max_batch_size}\n'
    text += _tensor_block("input", meta.inputs, batched) + _tensor_block("output", meta.outputs, batched)
    text += f"instance_group [ {{ kind: {'KIND_GPU' if gpu else 'KIND_CPU'} count: 1 }} ]\n"
    if batched:
        text += "dynamic_batching { }\n"
    return text


def run(ctx: StageContext) -> dict[str, Any]:
    cfg = ctx.config.package
    if not cfg.enabled:
        return {"status": "skipped", "models": []}
    validation = ValidationResult.read(ctx.inputs["validate"] / "validation.json",
                                       hint="run `kiln run --from validate`")
    if not validation.passed:  # `kiln package` after a failed gate: keep the last good package
        raise GateFailure(f"validation failed ({'; '.join(validation.failures) or 'see report.md'}): "
                          "nothing is packaged", hint="fix the engines, or relax validate.gates if the numbers are "
                                                      "acceptable, then `kiln run` again")
    results = {e.name: e for e in validation.engines}
    packaged = []
    for engine_dir in engine_dirs(ctx.inputs["build"]):
        meta = read_metadata(engine_dir)
        result = results.get(meta.name)
        if result is None or result.passed is not True:
            continue  # only engines proven against PyTorch are served
        shutil.copytree(engine_dir, ctx.out / "engines" / meta.name)
        record: dict[str, Any] = {"engine": meta.name, "validation": result.model_dump(
            mode="json", include={"max_abs_err", "cosine", "top1_agreement", "accuracy", "latency_ms"})}
        triton = BACKENDS[meta.backend].triton
        if cfg.triton and triton is not None:
            model_name = re.sub(r"[^A-Za-z0-9_]", "_", f"{ctx.config.name}_{meta.name}")
            target = ctx.out / "triton" / model_name
            (target / "1").mkdir(parents=True)
            shutil.copy2(engine_dir / meta.files["model"], target / "1" / triton.model_file)
            (target / "config.pbtxt").write_text(triton_config(model_name, meta, cfg.max_batch_size))
            record["triton_model"] = model_name
        packaged.append(record)
    (ctx.out / "kiln-package.json").write_text(json.dumps({"name": ctx.config.name, "models": packaged}, indent=2))
    return {"models": packaged}


STAGE = Stage("package", run, ("train", "build", "validate"), ("name", "package"), (sys.modules[__name__],),
              lambda cfg: {}, "serving artifacts: engines + metadata, Triton model repository")
