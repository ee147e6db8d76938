"""Pipeline entry of the build stage: every (backend, device, precision) engine the config asks for."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from pipeline.artifacts import hash_json
from pipeline.errors import BackendUnavailable
from pipeline.onnx_io import load_onnx
from pipeline.stage import StageContext
from stages.build.engines import SIDECAR
from stages.build.onnxruntime_backend import build_ort_engine, io_spec
from stages.build.tensorrt_backend import build_trt_engine, import_tensorrt


def run(ctx: StageContext) -> dict[str, Any]:
    cfg = ctx.config.build
    variants = json.loads((ctx.inputs["precision"] / "variants.json").read_text())
    data = ctx.dataset()
    max_batch = max(ctx.config.validate_.batch_sizes)
    engines: list[dict[str, Any]] = []
    skipped: list[str] = []
    for precision, variant in variants.items():
        onnx_path = ctx.inputs["precision"] / variant["path"]
        inputs, outputs = io_spec(load_onnx(onnx_path, load_external_data=False))
        jobs: list[tuple[str, str]] = []
        if "onnxruntime" in cfg.backends:
            jobs += [("onnxruntime", d) for d in cfg.onnxruntime.devices]
        if "tensorrt" in cfg.backends and cfg.tensorrt.enabled != "never":
            if import_tensorrt() is None:
                if cfg.tensorrt.enabled == "always":
                    raise BackendUnavailable("build.tensorrt.enabled is 'always' but TensorRT does not import",
                                             hint="pip install 'kiln[rtx]' or set build.tensorrt.enabled: auto")
                skipped.append(f"tensorrt-{precision}: no tensorrt/tensorrt_rtx package")
            else:
                jobs.append(("tensorrt", "cuda"))
        for backend, device in jobs:
            name = f"{backend}-{device}-{precision}" if backend == "onnxruntime" else f"{backend}-{precision}"
            out = ctx.out / name
            out.mkdir()
            t0 = time.perf_counter()
            with ctx.progress.task(f"building {name}", total=1) as bar:
                if backend == "onnxruntime":
                    built = build_ort_engine(onnx_path, out, device, cfg.onnxruntime)
                else:
                    built = build_trt_engine(onnx_path, out, cfg.tensorrt, data.input_shape, max_batch)
                bar.advance()
            meta = {"name": name, "backend": backend, "device": device, "precision": precision,
                    "inputs": inputs, "outputs": outputs, "build_seconds": time.perf_counter() - t0,
                    "settings_hash": hash_json(cfg.model_dump(mode="json")), **built}
            meta["size_bytes"] = sum(f.stat().st_size for f in out.iterdir())
            (out / SIDECAR).write_text(json.dumps(meta, indent=2, sort_keys=True))
            engines.append({k: meta[k] for k in ("name", "backend", "device", "precision", "build_seconds", "size_bytes")})
            ctx.log.info("built %s in %.1fs", name, meta["build_seconds"])
    return {"engines": engines, "skipped": skipped}
