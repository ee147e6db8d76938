"""TensorRT engines over TensorRT 10/11 or TensorRT-RTX, whichever imports. ``build.py`` parses and builds,
``runtime.py`` runs, ``weak.py`` is TensorRT 10's flag-based precision, ``profiles.py`` the optimization profiles.
The modules that need TensorRT (or torch, for device buffers) load when an engine is built or opened."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.core.errors import BackendUnavailable
from kiln.core.records import EngineMetadata
from kiln.stages.engines.backend import Backend, BuildRequest, Built, Plan, Runner, TritonModel
from kiln.stages.engines.tensorrt import lib as tensorrt_lib
from kiln.stages.engines.tensorrt.config import TensorRTConfig
from kiln.stages.engines.tensorrt.record import TensorRTRecord


def _build(req: BuildRequest) -> Built:
    from kiln.stages.engines.tensorrt.build import build_trt_engine
    from kiln.stages.engines.tensorrt.profiles import check_profiles, default_profiles

    profiles = list(req.settings.profiles) or default_profiles(req.inputs, req.max_batch, req.axis_sizes)
    check_profiles(profiles, req.inputs, req.axis_sizes)
    built = build_trt_engine(req.onnx_path, req.out, req.precision, req.settings, profiles, req.cache_dir)
    smallest = min(shape.min[0] for profile in profiles for shape in profile.values())
    largest = max(shape.max[0] for profile in profiles for shape in profile.values())
    info = TensorRTRecord(**{k: v for k, v in built.items() if k in TensorRTRecord.model_fields})
    return Built(
        built["files"], built["flavour"], built["versions"], info, built["builder_settings"], (smallest, largest)
    )


def _plan(cfg: TensorRTConfig, precision: str) -> Plan:
    """Build for CUDA unless switched off; with no TensorRT package, ``auto`` skips (reported), ``always`` fails."""
    if cfg.enabled == "never":
        return Plan([])
    if tensorrt_lib.import_tensorrt() is None:
        if cfg.enabled == "always":
            raise BackendUnavailable(
                "build.tensorrt.enabled is 'always' but TensorRT does not import",
                hint="pip install 'kiln[rtx]' or set build.tensorrt.enabled: auto",
            )
        return Plan([], [f"tensorrt-{precision}: no tensorrt/tensorrt_rtx package"])
    return Plan(["cuda"])


def _can_run(meta: EngineMetadata) -> tuple[bool, str]:
    from kiln.stages.engines.tensorrt.runtime import can_execute

    return can_execute(tensorrt_lib.import_tensorrt(meta.flavour), meta)


def _runner(engine_dir: Path, meta: EngineMetadata, info: Any) -> Runner:
    from kiln.stages.engines.tensorrt.runtime import TensorRTRunner

    return TensorRTRunner(engine_dir, meta, info)


BACKEND = Backend(
    name="tensorrt",
    devices=("cuda",),
    config=TensorRTConfig,
    record=TensorRTRecord,
    build=_build,
    runners={"cuda": _runner},
    plan=_plan,
    can_run=_can_run,
    libraries=("tensorrt", "tensorrt-rtx"),
    triton=TritonModel("tensorrt_plan", "model.plan"),
    triton_loads=lambda meta: meta.flavour != "tensorrt_rtx",  # Triton's tensorrt_plan backend is full TensorRT
    # auto: the other engines are still useful when TensorRT cannot build this graph; the failure is reported
    optional=lambda cfg: cfg.enabled != "always",
    rank=0,  # preferred where it runs and keeps up
)
