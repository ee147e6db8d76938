"""The environment a stage's result depends on: library versions and the device.

The device's facts come from torch (``torch.cuda``), whose import is most of the time of a run where every stage
is cached. So they are kept in the workdir's cache folder (:func:`keep_facts_in`) under what decides torch's answer
in this boot of this machine (:func:`_identity`), and read back while that stays the same.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import platform
import sys
from functools import cache
from pathlib import Path
from typing import Any

from kiln.core.artifacts import keep_json
from kiln.core.cpu_int8 import int8_kernels

FACTS_FILE = "device-facts.json"
FACTS_FORMAT = 1  # of the identity the facts are kept under: a file of another format is asked anew
# what selects or hides GPUs from a CUDA program: a different value is a different device for the same machine
DEVICE_VARIABLES = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "HIP_VISIBLE_DEVICES")
_facts_folder: list[Path] = []  # where device facts are kept (the runner's workdir cache); none: not kept

BASE_DISTS = ("torch", "onnx", "onnxruntime", "onnx-graphsurgeon", "numpy")  # what every run uses


@cache
def version(dist: str) -> str | None:
    """The installed version of a distribution, or None."""
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def keep_facts_in(folder: Path | None) -> None:
    """Keep :func:`device_facts` in ``folder`` (a workdir's cache) from now on in this process; None: do not."""
    _facts_folder[:] = [] if folder is None else [Path(folder)]
    device_facts.cache_clear()


def _identity() -> dict[str, Any] | None:
    """What decides torch's device facts, read without torch: this boot of the machine (a GPU is not added or taken
    away while it runs), the interpreter, torch's version, the NVIDIA driver, the GPUs it lists, the GPU device
    files this process sees (a container's), the MIG instances, and the variables that select GPUs. None where the
    boot cannot be told (not Linux): the facts are then asked of torch each time."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None
    nvidia = Path("/proc/driver/nvidia")
    try:
        driver = (nvidia / "version").read_text().splitlines()[0]
        gpus = sorted(p.name for p in (nvidia / "gpus").iterdir())
    except (OSError, IndexError):
        driver, gpus = None, []
    dev = Path("/dev")
    return {
        "format": FACTS_FORMAT,
        "boot": boot,
        "python": [sys.executable, sys.version],
        # the device files a container was given, and MIG instances (a GPU split anew is another device)
        "device_files": sorted(p.name for p in dev.glob("nvidia[0-9]*")),
        "mig": sorted(str(p.relative_to(nvidia)) for p in nvidia.glob("capabilities/gpu*/mig/gi*")),
        "torch": version("torch"),
        "driver": driver,
        "gpus": gpus,
        "variables": {v: os.environ.get(v) for v in DEVICE_VARIABLES},
    }


@cache
def device_facts() -> dict[str, Any]:
    """Python, machine, CUDA and GPU identity, and the CPU's INT8 kernels; read back from the workdir's cache
    while :func:`_identity` is unchanged."""
    identity = _identity() if _facts_folder else None
    path = _facts_folder[0] / FACTS_FILE if _facts_folder else None
    if identity is not None and path is not None:
        try:
            kept = json.loads(path.read_text())
            if isinstance(kept, dict) and kept.get("identity") == identity and isinstance(kept.get("facts"), dict):
                return kept["facts"]
        except (OSError, UnicodeDecodeError, ValueError):
            pass  # none kept yet, or unreadable: asked of torch and written again
    facts = _torch_facts()
    if identity is not None and path is not None:
        keep_json(path, {"identity": identity, "facts": facts})  # else asked of torch next time too
    return facts


def _torch_facts() -> dict[str, Any]:
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
