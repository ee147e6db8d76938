"""Engine folders: a model file plus ``kiln-engine.json`` (:class:`EngineMetadata`), and the runner base class.

Runners follow Polygraphy's shape: ``activate`` (load; heavy work happens here, not in ``__init__``),
``infer`` (dict of numpy arrays in, dict out), ``deactivate``; they are context managers. Each backend's runners
import their library only in ``activate``, so this package imports without onnxruntime-gpu or TensorRT. Open an
engine with :func:`kiln.stages.engines.registry.load_engine` (also ``kiln.load_engine``).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from kiln.core.artifacts import hash_file
from kiln.core.errors import InputFileError
from kiln.core.records import EngineMetadata

SIDECAR = "kiln-engine.json"
REBUILD = "rebuild the engine: `kiln build` (or `kiln run --force build` in a workdir)"


def read_metadata(engine_dir: Path) -> EngineMetadata:
    p = Path(engine_dir) / SIDECAR
    if not p.is_file():
        raise InputFileError(
            f"{engine_dir} is not a Kiln engine (no {SIDECAR})", hint="point at a folder `kiln build` wrote"
        )
    return EngineMetadata.read(p, hint=REBUILD)


def engine_dirs(folder: Path) -> list[Path]:
    """The engine folders directly under ``folder`` (a build stage's output), in name order."""
    return sorted(p.parent for p in Path(folder).glob(f"*/{SIDECAR}"))


def verify_files(engine_dir: Path, meta: EngineMetadata) -> None:
    """Every file the metadata lists is there with its recorded content: a damaged engine is refused, not run."""
    for name, digest in meta.file_hashes.items():
        path = Path(engine_dir) / name
        if not path.is_file():
            raise InputFileError(f"engine {meta.name}: {name} is missing from {engine_dir}", hint=REBUILD)
        if hash_file(path) != digest:
            raise InputFileError(
                f"engine {meta.name}: {name} does not match its recorded sha256 (the file changed after the build)",
                hint=REBUILD,
            )


class Runner:
    """Base runner. Subclasses implement ``_activate``, ``_infer`` and ``_deactivate``."""

    per_shape_sessions = False  # True: each new input shape costs a build (a session, a CUDA graph capture)

    def __init__(self, engine_dir: Path, meta: EngineMetadata) -> None:
        self.engine_dir, self.meta, self.active = Path(engine_dir), meta, False
        self.name = meta.name

    @property
    def input_names(self) -> list[str]:
        return [i.name for i in self.meta.inputs]

    def activate(self) -> Runner:
        if not self.active:
            self._activate()
            self.active = True
        return self

    def deactivate(self) -> None:
        if self.active:
            self._deactivate()
            self.active = False

    def __enter__(self) -> Runner:
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
