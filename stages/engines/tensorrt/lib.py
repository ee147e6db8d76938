"""Finding TensorRT: which flavour imports here (TensorRT 10/11 or TensorRT-RTX), what it can do, and this machine's
GPU. Imported lazily: Kiln works without any TensorRT installed."""

from __future__ import annotations

import importlib
from types import ModuleType

from kiln.core.errors import BackendUnavailable

FLAVOURS = ("tensorrt", "tensorrt_rtx")


def import_tensorrt(flavour: str | None = None) -> ModuleType | None:
    for name in (flavour,) if flavour else FLAVOURS:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


def require_tensorrt() -> ModuleType:
    trt = import_tensorrt()
    if trt is None:
        raise BackendUnavailable(
            "no TensorRT package imports (tried tensorrt, tensorrt_rtx)",
            hint="pip install 'kiln[rtx]' (TensorRT-RTX) or 'kiln[tensorrt]'",
        )
    return trt


def features(trt: ModuleType) -> dict[str, bool]:
    """What this TensorRT can do, detected from its API rather than its version number."""
    flags, cfg = trt.BuilderFlag, trt.IBuilderConfig
    return {
        "strongly_typed": hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED"),
        "fp16_flag": hasattr(flags, "FP16"),
        "int8_flag": hasattr(flags, "INT8"),
        "int8_calibrator": hasattr(trt, "IInt8EntropyCalibrator2"),
        "compute_capability_targets": hasattr(cfg, "set_compute_capability"),
        "runtime_cache": hasattr(trt, "IRuntimeCache"),
        # TensorRT-RTX keeps the timing-cache API but documents it as a no-op.
        "timing_cache": trt.__name__ != "tensorrt_rtx",
    }


def local_gpu() -> dict[str, str] | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return {
        "name": torch.cuda.get_device_name(0),
        "compute_capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
    }
