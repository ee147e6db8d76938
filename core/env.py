"""The environment a stage's result depends on: library versions and the device."""

from __future__ import annotations

import importlib.metadata as md
import platform
from functools import lru_cache
from typing import Any

from kiln.core.cpu_int8 import int8_kernels

_DISTS = ("torch", "onnx", "onnxruntime", "onnxruntime-gpu", "onnx-graphsurgeon", "tensorrt", "tensorrt-rtx", "numpy")


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


@lru_cache(maxsize=1)
def environment() -> dict[str, Any]:
    """Versions of the libraries that shape results, plus CPU/GPU identity."""
    import torch

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "versions": {d: v for d in _DISTS if (v := _version(d)) is not None},
        "cuda_available": torch.cuda.is_available(),
        # ONNX Runtime CPU INT8 latencies here are of its exact, slower kernels where the fast ones saturate
        "cpu_int8_kernels": int8_kernels(),
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["compute_capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    return env


def environment_subset(*dists: str, device: bool = False) -> dict[str, Any]:
    """Only the parts of :func:`environment` a given stage depends on (keeps its cache key stable)."""
    env = environment()
    out: dict[str, Any] = {"versions": {d: env["versions"].get(d) for d in dists}}
    if device:
        out.update({k: env.get(k) for k in ("cuda_available", "gpu", "compute_capability", "machine")})
    return out
