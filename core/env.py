"""The environment a stage's result depends on: library versions and the device."""

from __future__ import annotations

import importlib.metadata as md
import platform
from functools import cache
from typing import Any

from kiln.core.cpu_int8 import int8_kernels

BASE_DISTS = ("torch", "onnx", "onnxruntime", "onnx-graphsurgeon", "numpy")  # what every run uses


@cache
def version(dist: str) -> str | None:
    """The installed version of a distribution, or None."""
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


@cache
def device_facts() -> dict[str, Any]:
    """Python, machine, CUDA and GPU identity, and the CPU's INT8 kernels."""
    import torch

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cuda_available": torch.cuda.is_available(),
        # ONNX Runtime CPU INT8 latencies here are of its exact, slower kernels where the fast ones saturate
        "cpu_int8_kernels": int8_kernels(),
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["compute_capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    return env


def environment(*dists: str) -> dict[str, Any]:
    """Versions of the libraries that shape results (:data:`BASE_DISTS` and ``dists``, those installed), plus
    CPU/GPU identity."""
    versions = {d: v for d in dict.fromkeys((*BASE_DISTS, *dists)) if (v := version(d)) is not None}
    return {**device_facts(), "versions": versions}


def environment_subset(*dists: str, device: bool = False) -> dict[str, Any]:
    """Only the parts of :func:`environment` a given stage depends on (keeps its cache key stable)."""
    out: dict[str, Any] = {"versions": {d: version(d) for d in dists}}
    if device:
        facts = device_facts()
        out.update({k: facts.get(k) for k in ("cuda_available", "gpu", "compute_capability", "machine")})
    return out
