"""Engine directories: a model file plus ``kiln-engine.json``, and the runners that execute them.

Runners follow Polygraphy's shape: ``activate`` (load; heavy work happens here, not in ``__init__``),
``infer`` (dict of numpy arrays in, dict out), ``deactivate``; they are context managers.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.errors import BackendUnavailable, InputFileError

SIDECAR = "kiln-engine.json"


def read_metadata(engine_dir: Path) -> dict[str, Any]:
    p = Path(engine_dir) / SIDECAR
    if not p.is_file():
        raise InputFileError(f"{engine_dir} is not a Kiln engine (no {SIDECAR})", hint="point at a folder `kiln build` wrote")
    return json.loads(p.read_text())


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


class OnnxRuntimeRunner(Runner):
    def _activate(self) -> None:
        import onnxruntime as ort

        settings = self.meta.get("session", {})
        providers = settings.get("providers", ["CPUExecutionProvider"])
        missing = [p for p in providers if p not in ort.get_available_providers()]
        if missing:
            raise BackendUnavailable(f"engine {self.name} needs {missing}, not available in this onnxruntime",
                                     hint="install onnxruntime-gpu (pip install 'kiln[gpu]') on a CUDA machine")
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = settings.get("intra_op_threads", 0)
        opts.log_severity_level = 3
        # The saved model is already optimized offline; redoing it at load would only cost start-up time.
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        self.session = ort.InferenceSession(str(self.engine_dir / self.meta["files"]["model"]), opts,
                                            providers=providers)
        self.output_names = [o.name for o in self.session.get_outputs()]

    def _infer(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(self.output_names, self.session.run(None, feed)))

    def _deactivate(self) -> None:
        del self.session


RUNNERS: dict[str, type[Runner]] = {"onnxruntime": OnnxRuntimeRunner}


def runnable(meta: dict[str, Any]) -> tuple[bool, str]:
    """Whether this machine can execute the engine, and why not."""
    if meta["backend"] not in RUNNERS:
        return False, meta.get("not_runnable_reason") or f"no runner for backend '{meta['backend']}' on this machine"
    if meta.get("device") == "cuda":
        import onnxruntime as ort

        if "CUDAExecutionProvider" not in ort.get_available_providers():
            return False, "CUDAExecutionProvider not available (needs onnxruntime-gpu and a CUDA GPU)"
    return True, ""


def load_engine(engine_dir: str | Path) -> Runner:
    """Open a Kiln engine folder for serving: ``with load_engine(path) as r: r.infer({'input': x})``."""
    meta = read_metadata(Path(engine_dir))
    ok, why = runnable(meta)
    if not ok:
        raise BackendUnavailable(f"cannot run engine {meta['name']}: {why}")
    return RUNNERS[meta["backend"]](Path(engine_dir), meta)
