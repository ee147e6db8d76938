"""Engine directories: a model file plus ``kiln-engine.json``, and the runners that execute them.

Serving code opens an engine with :func:`load_engine`::

    with load_engine("out/onnxruntime-cuda-fp16") as runner:
        outputs = runner.infer({"input": batch})

Runners follow Polygraphy's shape: ``activate`` (load; heavy work happens here, not in ``__init__``),
``infer`` (dict of numpy arrays in, dict out), ``deactivate``; they are context managers. Backends' runner
modules are imported lazily, so this module imports without onnxruntime-gpu or TensorRT.
"""
from __future__ import annotations

import importlib
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from kiln.core.errors import BackendUnavailable, ConfigError, InputFileError

SIDECAR = "kiln-engine.json"


def read_metadata(engine_dir: Path) -> dict[str, Any]:
    p = Path(engine_dir) / SIDECAR
    if not p.is_file():
        raise InputFileError(f"{engine_dir} is not a Kiln engine (no {SIDECAR})", hint="point at a folder `kiln build` wrote")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise InputFileError(f"{p} is corrupt ({exc})", hint="rebuild the engine") from None


def random_feed(inputs: list[dict[str, Any]], batch: int, seed: int = 0,
                hint: str = "pass concrete input arrays") -> dict[str, np.ndarray]:
    """Inputs of an engine's declared shapes (``kiln-engine.json`` "inputs"), ``batch`` on a dynamic batch
    axis (a model exported with a fixed batch keeps it); ids in [0, 2) so any embedding accepts them. Any
    other axis must be a fixed size."""
    rng = np.random.default_rng(seed)
    feed = {}
    for spec in inputs:
        first, rest = spec["shape"][0], spec["shape"][1:]
        if any(not isinstance(d, int) or d < 1 for d in rest):
            raise ConfigError(f"input '{spec['name']}' has dynamic axes {spec['shape']} besides the batch axis",
                              hint=hint)
        fixed_batch = isinstance(first, int) and first >= 1
        shape, dtype = (first if fixed_batch else batch, *rest), np.dtype(spec["dtype"])
        values = rng.integers(0, 2, shape) if dtype.kind in "iu" else rng.standard_normal(shape)
        feed[spec["name"]] = values.astype(dtype)
    return feed


class Runner:
    """Base runner. Subclasses implement ``_activate``, ``_infer`` and ``_deactivate``."""

    def __init__(self, engine_dir: Path, meta: dict[str, Any]) -> None:
        self.engine_dir, self.meta, self.active = Path(engine_dir), meta, False
        self.name = meta["name"]

    @property
    def input_names(self) -> list[str]:
        return [i["name"] for i in self.meta["inputs"]]

    def activate(self) -> "Runner":
        if not self.active:
            self._activate()
            self.active = True
        return self

    def deactivate(self) -> None:
        if self.active:
            self._deactivate()
            self.active = False

    def __enter__(self) -> "Runner":
        return self.activate()

    def __exit__(self, *exc: object) -> None:
        self.deactivate()

    def infer(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if not self.active:
            raise RuntimeError(f"runner {self.name} used before activate()")
        missing = set(self.input_names) - set(feed)
        if missing:
            raise InputFileError(f"engine {self.name} needs inputs {sorted(missing)}, got {sorted(feed)}")
        return self._infer(feed)

    def time_ms(self, feed: dict[str, np.ndarray], warmup: int, iterations: int) -> list[float]:
        """Latency of ``infer`` in ms, host arrays in and out (what a caller of the engine sees)."""
        for _ in range(warmup):
            self.infer(feed)
        times = []
        for _ in range(iterations):
            t0 = time.perf_counter()
            self.infer(feed)
            times.append((time.perf_counter() - t0) * 1e3)
        return times

    def _activate(self) -> None:
        raise NotImplementedError

    def _infer(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def _deactivate(self) -> None:
        pass


# (backend, device) -> "module:Class"; imported only when an engine of that kind is opened.
RUNNERS: dict[tuple[str, str], str] = {
    ("onnxruntime", "cpu"): "kiln.stages.engines.onnxruntime_runner:OrtCpuRunner",
    ("onnxruntime", "cuda"): "kiln.stages.engines.onnxruntime_runner:OrtCudaRunner",
    ("tensorrt", "cuda"): "kiln.stages.engines.tensorrt_runtime:TensorRTRunner",
}


def runnable(meta: dict[str, Any]) -> tuple[bool, str]:
    """Whether this machine can execute the engine, and why not (a sentence for reports)."""
    key = (meta.get("backend"), meta.get("device"))
    if key not in RUNNERS:
        return False, f"no runner for backend '{key[0]}' on device '{key[1]}'"
    if key[0] == "tensorrt":
        from kiln.stages.engines.tensorrt_backend import import_tensorrt
        from kiln.stages.engines.tensorrt_runtime import can_execute

        return can_execute(import_tensorrt(meta.get("flavour")), meta)
    if key[1] == "cuda":
        import onnxruntime as ort

        if "CUDAExecutionProvider" not in ort.get_available_providers():
            return False, "CUDAExecutionProvider not available (needs onnxruntime-gpu and a CUDA GPU)"
    return True, ""


def load_engine(engine_dir: str | Path) -> Runner:
    """Open a Kiln engine folder for serving: ``with load_engine(path) as r: r.infer({'input': x})``."""
    meta = read_metadata(Path(engine_dir))
    ok, why = runnable(meta)
    if not ok:
        raise BackendUnavailable(f"cannot run engine {meta['name']}: {why}",
                                 hint="run it on a machine that can (see the engine's kiln-engine.json)")
    module, _, cls = RUNNERS[(meta["backend"], meta["device"])].partition(":")
    return getattr(importlib.import_module(module), cls)(Path(engine_dir), meta)
