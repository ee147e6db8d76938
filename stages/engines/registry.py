"""The backends Kiln builds engines with, by name, and opening a built engine with the right runner.

A plain dict, like the optimize pass registry: a reader (and a type checker) sees every backend in one place. A
backend is one folder beside this file; registering it is one line below (or :func:`register` from anywhere).
Serving code opens an engine with :func:`load_engine`::

    with load_engine("out/onnxruntime-cuda-fp16") as runner:
        outputs = runner.infer({"input": batch})
"""

from __future__ import annotations

from pathlib import Path

from kiln.core.errors import BackendUnavailable, ConfigError
from kiln.core.records import EngineMetadata
from kiln.stages.engines import onnxruntime, tensorrt, torch
from kiln.stages.engines.backend import Backend, Runner, read_metadata, verify_files

BACKENDS: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    """Make ``backend`` buildable (``build.backends``), configurable (``build.<name>``) and loadable by name."""
    BACKENDS[backend.name] = backend
    return backend


register(onnxruntime.BACKEND)
register(tensorrt.BACKEND)
register(torch.BACKEND)


def backend_libraries(*names: str) -> list[str]:
    """The distributions engines of these backends (default: every registered one) depend on."""
    return list(dict.fromkeys(lib for name in names or BACKENDS for lib in BACKENDS[name].libraries))


def backend_named(name: str) -> Backend:
    if name not in BACKENDS:
        raise ConfigError(f"unknown backend '{name}'", hint=f"use one of {', '.join(sorted(BACKENDS))}")
    return BACKENDS[name]


def preference_order() -> list[str]:
    """Backend names, preferred first (``Backend.rank``; TensorRT first wherever it runs)."""
    return sorted(BACKENDS, key=lambda name: BACKENDS[name].rank)


def runnable(meta: EngineMetadata) -> tuple[bool, str]:
    """Whether this machine can execute the engine, and why not (a sentence for reports)."""
    backend = BACKENDS.get(meta.backend)
    if backend is None or meta.device not in backend.runners:
        return False, f"no runner for backend '{meta.backend}' on device '{meta.device}'"
    return backend.can_run(meta)


def load_engine(engine_dir: str | Path, serving: bool = False) -> Runner:
    """Open a Kiln engine folder, after checking its files against its metadata: ``with load_engine(path) as r:
    r.infer({'input': x})``. ``serving``: for a server's process (:class:`Runner`)."""
    meta = read_metadata(Path(engine_dir))
    verify_files(Path(engine_dir), meta)
    ok, why = runnable(meta)
    if not ok:
        raise BackendUnavailable(
            f"cannot run engine {meta.name}: {why}",
            hint="run it on a machine that can (see the engine's kiln-engine.json)",
        )
    backend = BACKENDS[meta.backend]
    runner = backend.runners[meta.device](Path(engine_dir), meta, backend.info(meta))
    runner.serving = serving
    return runner
