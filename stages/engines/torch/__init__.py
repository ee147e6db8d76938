"""PyTorch engines compiled by Inductor from the trained model itself (opt-in: ``build.backends: [..., torch]``):
an AOTInductor package, or the exported program with Inductor's caches. ``build.py`` exports and compiles,
``program.py`` is the compiled flavour at run time, ``runner.py`` runs, ``gemm_epilogues.py`` and
``conv_epilogues.py`` rewrite linear layers and convolutions into fused library calls, ``lowbit.py`` makes linear
layers FP8 or INT8 GEMMs. Those modules need torch and
load when an engine is built or opened."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.core.records import EngineMetadata
from kiln.stages.engines.backend import Backend, BuildRequest, Built, Plan, Runner
from kiln.stages.engines.torch.config import TorchConfig
from kiln.stages.engines.torch.record import TorchRecord


def _build(req: BuildRequest) -> Built:
    from kiln.stages.engines.torch.build import build_torch_engine

    built = build_torch_engine(req)
    return Built(
        built["files"],
        built["flavour"],
        built["versions"],
        TorchRecord(),
        built["builder_settings"],
        inputs=built.get("inputs"),
    )


def _plan(cfg: TorchConfig, precision: str) -> Plan:
    listed = cfg.devices if cfg.devices != "auto" else [_default_device()]
    gpu_only = {
        "fp16": "AOTInductor engines are FP32, or FP16 on the GPU",
        "fp8": "FP8 engines are for CUDA GPUs",
        "int8": "the torch backend's INT8 engines are for CUDA GPUs (ONNX Runtime builds the CPU's)",
    }
    devices = [d for d in listed if precision == "fp32" or (precision in gpu_only and d == "cuda")]
    skipped = [
        f"torch-{d}-{precision}: {gpu_only.get(precision, 'no such engine')}" for d in listed if d not in devices
    ]
    if precision in ("fp8", "int8") and devices:
        from kiln.stages.engines.torch.lowbit import supported

        if why := supported(precision):
            skipped, devices = [*skipped, f"torch-cuda-{precision}: {why}"], []
    return Plan(devices, skipped, by_default=cfg.devices == "auto")


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _can_run(meta: EngineMetadata) -> tuple[bool, str]:
    import torch

    built = meta.versions.get("torch")
    if built != torch.__version__:
        return False, (
            f"built with torch {built}, this is torch {torch.__version__} (AOTInductor packages are "
            "tied to the torch that built them)"
        )
    if meta.device == "cuda" and not torch.cuda.is_available():
        return False, "torch sees no CUDA GPU"
    return True, ""


def _runner(engine_dir: Path, meta: EngineMetadata, info: Any) -> Runner:
    from kiln.stages.engines.torch.runner import TorchRunner

    return TorchRunner(engine_dir, meta, info)


def _hints(meta: EngineMetadata, failures: list[str]) -> list[str]:
    """An engine that misses accuracy gates: the fused GEMM or convolution rewrites it used, as what to try."""
    from kiln.stages.engines.torch import conv_epilogues, fp8_epilogues, gemm_epilogues

    if not failures:
        return []
    hints = (
        gemm_epilogues.accuracy_hint(meta.builder_settings, meta.device),
        conv_epilogues.accuracy_hint(meta.builder_settings),
        fp8_epilogues.accuracy_hint(meta.builder_settings),
    )
    return [h for h in hints if h]


BACKEND = Backend(
    name="torch",
    devices=("cpu", "cuda"),
    config=TorchConfig,
    record=TorchRecord,
    build=_build,
    runners={"cpu": _runner, "cuda": _runner},
    plan=_plan,
    can_run=_can_run,
    libraries=("torch",),
    hints=_hints,
    # opt-in and model-dependent (torch.export cannot capture every model): a failure skips it, reported
    optional=lambda cfg: True,
    reads_graph=False,  # casts the PyTorch model to the engine's precision itself
    yields={
        "cpu": (
            "onnxruntime",
            "Inductor's CPU engines ran at 0.61-0.94x ONNX Runtime's FP32 engine after builds of minutes on the "
            "models measured (docs/engines.md)",
        )
    },
    rank=20,
)
