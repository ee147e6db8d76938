"""The build stage: :func:`build_engine` makes one engine folder; :func:`run` builds every (backend, device,
precision) engine the config asks for. ``kiln build model.onnx ...`` calls :func:`build_engine` directly."""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from kiln.core.artifacts import atomic_dir, hash_file, hash_json
from kiln.core.errors import BackendUnavailable, BuildError, ConfigError
from kiln.core.onnx_io import load_onnx
from kiln.core.progress import Progress, SilentProgress
from kiln.core.stage import StageContext
from kiln.stages.engines.config import BuildConfig
from kiln.stages.engines.engines import SIDECAR
from kiln.stages.engines.onnxruntime_backend import build_ort_engine, io_spec
from kiln.stages.engines.profiles import Profile, check_profiles, default_profiles
from kiln.stages.engines.tensorrt_backend import build_trt_engine, import_tensorrt

log = logging.getLogger("kiln.build")
BACKEND_DEVICES = {"onnxruntime": ("cpu", "cuda"), "tensorrt": ("cuda",)}
PRECISIONS = ("fp32", "fp16", "int8")


def engine_name(backend: str, device: str, precision: str) -> str:
    return f"{backend}-{device}-{precision}" if backend == "onnxruntime" else f"{backend}-{precision}"


def build_engine(onnx_path: Path, out_dir: Path, backend: str, device: str, precision: str, cfg: BuildConfig,
                 cache_dir: Path, progress: Progress | None = None, *, max_batch: int = 32, name: str | None = None,
                 keep_fp32: list[str] | None = None) -> dict[str, Any]:
    """Build one engine into ``out_dir`` (replaced atomically) and return its metadata (``kiln-engine.json``).

    ``max_batch`` bounds the default TensorRT profile (dynamic batch 1..max_batch) when the config gives none.
    """
    _check_choice(backend, device, precision)
    onnx_path, out_dir = Path(onnx_path), Path(out_dir)
    inputs, outputs = io_spec(load_onnx(onnx_path, load_external_data=False))
    name = name or engine_name(backend, device, precision)
    profiles: list[Profile] = []
    if backend == "tensorrt":
        profiles = list(cfg.tensorrt.profiles) or default_profiles(inputs, max_batch)
        check_profiles(profiles, inputs)
    section = cfg.onnxruntime if backend == "onnxruntime" else cfg.tensorrt
    t0 = time.perf_counter()
    with (progress or SilentProgress()).task(f"building {name}", total=1) as bar, atomic_dir(out_dir) as out:
        if backend == "onnxruntime":
            built = build_ort_engine(onnx_path, out, device, precision, cfg.onnxruntime, keep_fp32, max_batch)
        else:
            built = build_trt_engine(onnx_path, out, precision, cfg.tensorrt, profiles, Path(cache_dir))
        meta: dict[str, Any] = {
            "name": name, "backend": backend, "device": device, "precision": precision,
            "inputs": inputs, "outputs": outputs, "source": {"file": onnx_path.name, "sha256": hash_file(onnx_path)},
            **built, "build_seconds": round(time.perf_counter() - t0, 3),
        }
        if keep_fp32:  # an FP16 engine converted from the FP32 graph: which nodes the precision stage kept FP32
            meta["source"]["kept_fp32"] = sorted(keep_fp32)
        meta["settings_hash"] = hash_json({"backend": backend, "device": device, "precision": precision,
                                           "settings": section.model_dump(mode="json"), "profiles": meta.get("profiles"),
                                           "source": meta["source"]["sha256"], "kept_fp32": sorted(keep_fp32 or []),
                                           "versions": meta.get("versions")})
        meta["size_bytes"] = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
        (out / SIDECAR).write_text(json.dumps(meta, indent=2, sort_keys=True, default=str))
        bar.advance()
    log.info("built %s in %.1fs (%.1f MB)", name, meta["build_seconds"], meta["size_bytes"] / 1e6)
    return meta


def _check_choice(backend: str, device: str, precision: str) -> None:
    if backend not in BACKEND_DEVICES:
        raise ConfigError(f"unknown backend '{backend}'", hint=f"use one of {sorted(BACKEND_DEVICES)}")
    if device not in BACKEND_DEVICES[backend]:
        raise ConfigError(f"backend '{backend}' cannot build for device '{device}'",
                          hint=f"use --device {' or '.join(BACKEND_DEVICES[backend])}")
    if precision not in PRECISIONS:
        raise ConfigError(f"unknown precision '{precision}'", hint=f"use one of {', '.join(PRECISIONS)}")


def _jobs(cfg: BuildConfig, skipped: list[str], precision: str) -> list[tuple[str, str]]:
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
    return jobs


def run(ctx: StageContext) -> dict[str, Any]:
    cfg = ctx.config.build
    root = ctx.inputs["precision"]
    variants = json.loads((root / "variants.json").read_text())
    max_batch = max(ctx.config.validate_.batch_sizes)
    engines: list[dict[str, Any]] = []
    skipped: list[str] = []
    for precision, variant in variants.items():
        for backend, device in _jobs(cfg, skipped, precision):
            # A variant may carry a graph tuned for one backend (e.g. uint8 activations for ORT on CPU).
            src = root / variant.get("backend_paths", {}).get(f"{backend}-{device}", variant["path"])
            keep = None  # a variant's own graph already carries its FP32 nodes
            if (backend, precision) == ("onnxruntime", "fp16") and cfg.onnxruntime.fp16_source == "fp32_graph" \
                    and "fp32" in variants:
                src = root / variants["fp32"]["path"]  # ORT fuses first, then converts (see fp16_source)
                keep = variant.get("kept_fp32")  # ... keeping what the precision stage kept FP32
            name = engine_name(backend, device, precision)
            try:
                try:
                    meta = build_engine(src, ctx.out / name, backend, device, precision, cfg, ctx.cache_dir,
                                        ctx.progress, max_batch=max_batch, keep_fp32=keep)
                except BuildError as exc:
                    if keep is None:
                        raise
                    # ORT's converter cannot convert some graphs (control flow, sequences: an nn.EmbeddingBag)
                    # that the precision stage's FP16 graph handles, and that graph passed the ONNX checker.
                    ctx.log.warning("%s: %s; building it from the precision stage's FP16 graph instead",
                                    name, exc.message)
                    meta = build_engine(root / variant["path"], ctx.out / name, backend, device, precision, cfg,
                                        ctx.cache_dir, ctx.progress, max_batch=max_batch)
            except BuildError as exc:
                if backend != "tensorrt" or cfg.tensorrt.enabled == "always":
                    raise
                # auto: the other engines are still useful; the failure is reported, never silent.
                ctx.log.warning("skipping %s: %s", name, exc)
                skipped.append(f"{name}: {exc.message} (fix: {exc.hint})")
                continue
            engines.append({k: meta[k] for k in ("name", "backend", "device", "precision", "build_seconds",
                                                 "size_bytes")})
    return {"engines": engines, "skipped": skipped}
