"""ONNX Runtime engines (CPU and CUDA): the graph optimized offline by ONNX Runtime beside its session settings,
autotuned on the build machine. ``build.py`` builds, ``runner.py`` runs, ``autotune.py`` times settings.

This module registers the backend and imports only its config and record: the modules that need ONNX and ONNX
Runtime load when an engine is built or opened, so reading a config stays fast."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.core.records import EngineMetadata, PrecisionVariant
from kiln.stages.engines.backend import Backend, BuildRequest, Built, Plan, Runner, TritonModel
from kiln.stages.engines.onnxruntime.config import OnnxRuntimeConfig
from kiln.stages.engines.onnxruntime.record import OrtRecord


def _build(req: BuildRequest) -> Built:
    from kiln.stages.engines.onnxruntime.build import build_ort_engine

    built = build_ort_engine(
        req.onnx_path,
        req.out,
        req.device,
        req.precision,
        req.settings,
        req.keep_fp32,
        req.max_batch,
        req.name,
        req.axis_sizes,
        req.check_graph,
    )
    info = OrtRecord(session=built["session"], cuda_graph=built["cuda_graph"], autotune=built.get("autotune"))
    return Built(built["files"], built["flavour"], built["versions"], info, built["builder_settings"])


def _cpu_runner(engine_dir: Path, meta: EngineMetadata, info: Any) -> Runner:
    from kiln.stages.engines.onnxruntime.runner import OrtCpuRunner

    return OrtCpuRunner(engine_dir, meta, info)


def _cuda_runner(engine_dir: Path, meta: EngineMetadata, info: Any) -> Runner:
    from kiln.stages.engines.onnxruntime.runner import OrtCudaRunner

    return OrtCudaRunner(engine_dir, meta, info)


def _can_run(meta: EngineMetadata) -> tuple[bool, str]:
    import onnxruntime as ort

    if meta.device == "cuda" and "CUDAExecutionProvider" not in ort.get_available_providers():
        return False, "CUDAExecutionProvider not available (needs onnxruntime-gpu and a CUDA GPU)"
    return True, ""


def _source(
    backend: Backend, device: str, precision: str, variants: dict[str, PrecisionVariant], cfg: OnnxRuntimeConfig
) -> tuple[str, list[str] | None]:
    """FP16 engines from the FP32 graph by default: ORT fuses first, then converts (see ``fp16_source``),
    keeping what the precision stage kept FP32. Otherwise the variant's own graph, which carries its FP32 nodes."""
    if precision == "fp16" and cfg.fp16_source == "fp32_graph" and "fp32" in variants:
        return variants["fp32"].path, variants["fp16"].kept_fp32
    variant = variants[precision]
    return variant.backend_paths.get(f"{backend.name}-{device}", variant.path), None


def _plan(cfg: OnnxRuntimeConfig, precision: str) -> Plan:
    """Every configured device, except for FP8: ONNX Runtime's providers have no FP8 kernels and would run an FP8
    Q/DQ graph in float (that graph is TensorRT's)."""
    if precision == "fp8":
        why = "ONNX Runtime has no FP8 kernels (the FP8 Q/DQ graph is TensorRT's; torch builds FP8 GPU engines)"
        return Plan([], [f"onnxruntime-{d}-fp8: {why}" for d in cfg.devices])
    return Plan(list(cfg.devices))


BACKEND = Backend(
    name="onnxruntime",
    devices=("cpu", "cuda"),
    config=OnnxRuntimeConfig,
    record=OrtRecord,
    build=_build,
    runners={"cpu": _cpu_runner, "cuda": _cuda_runner},
    plan=_plan,
    can_run=_can_run,
    libraries=("onnxruntime", "onnxruntime-gpu"),
    triton=TritonModel("onnxruntime_onnx", "model.onnx"),
    source=_source,
    rank=10,
)
