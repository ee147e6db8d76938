"""TensorRT's timing cache on disk: loaded before a build, merged and saved after it, under a file lock.

One file per (flavour, version, target) under ``cache_dir/tensorrt/``, shared by every build of a run and across
runs. Builds do not hold the lock while building (that would serialize parallel builds): the cache is read under
the lock, the build runs, then the file is re-read under the lock, our entries are combined into it with
``ITimingCache.combine`` and it is replaced atomically, so concurrent builders never lose each other's entries.

TensorRT-RTX accepts these calls but treats them as no-ops (its kernels are JIT-compiled on the target GPU);
its persistent cache is the *runtime cache* (``IRuntimeCache``) that the runner loads and saves, see
:func:`runtime_cache_path`.
"""

from __future__ import annotations

import logging
import re
import warnings
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

from filelock import FileLock

from kiln.core.artifacts import write_bytes_atomic

log = logging.getLogger("kiln.build")
LOCK_TIMEOUT_S = 600


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-").lower()


def timing_cache_path(cache_dir: Path, trt: ModuleType, target: str) -> Path:
    return Path(cache_dir) / "tensorrt" / f"timing-{trt.__name__}-{trt.__version__}-{_slug(target)}.cache"


def runtime_cache_path(cache_dir: Path, trt: ModuleType, target: str) -> Path:
    return Path(cache_dir) / "tensorrt" / f"runtime-{trt.__name__}-{trt.__version__}-{_slug(target)}.cache"


def _lock(path: Path) -> FileLock:
    path.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(str(path) + ".lock", timeout=LOCK_TIMEOUT_S)


def read_locked(path: Path) -> bytes:
    with _lock(path):
        return path.read_bytes() if path.is_file() else b""


@contextmanager
def _quiet_rtx() -> Any:
    """TensorRT-RTX warns on every timing-cache call that it is a no-op; the metadata says so once instead."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Timing cache operations are no-ops.*")
        yield


def attach_timing_cache(config: Any, path: Path) -> dict[str, Any]:
    """Load the cache file into ``config``; returns what was loaded, for the metadata."""
    with _quiet_rtx():
        return _attach(config, path)


def _attach(config: Any, path: Path) -> dict[str, Any]:
    data = read_locked(path)
    cache = config.create_timing_cache(data)
    if cache is None and data:  # a corrupt or foreign file: start afresh rather than fail the build
        log.warning("timing cache %s is unreadable; starting an empty one", path)
        data, cache = b"", config.create_timing_cache(b"")
    config.set_timing_cache(cache, ignore_mismatch=False)
    return {"path": str(path), "loaded_bytes": len(data)}


def save_timing_cache(config: Any, path: Path) -> int:
    """Merge the build's timing cache into the file (under the lock) and replace it atomically."""
    with _quiet_rtx():
        return _save(config, path)


def _save(config: Any, path: Path) -> int:
    ours = config.get_timing_cache()
    if ours is None:
        return 0
    with _lock(path):
        current = path.read_bytes() if path.is_file() else b""
        if current:
            merged = config.create_timing_cache(current)
            if merged is not None and merged.combine(ours, ignore_mismatch=True):
                ours = merged
        data = bytes(ours.serialize())
        write_bytes_atomic(path, data)
    return len(data)


def load_runtime_cache(runtime_config: Any, path: Path) -> Any:
    """TensorRT-RTX: a runtime cache filled from ``path`` and attached to ``runtime_config``."""
    cache = runtime_config.create_runtime_cache()
    data = read_locked(path)
    if data:
        try:
            if cache.deserialize(data) is False:
                raise ValueError("deserialize returned False")
        except Exception as exc:  # a torn or foreign file only costs the JIT work it would have saved
            log.warning("ignoring unreadable TensorRT-RTX runtime cache %s (%s); starting empty", path, exc)
            cache = runtime_config.create_runtime_cache()
    runtime_config.set_runtime_cache(cache)
    return cache


def save_runtime_cache(cache: Any, path: Path) -> None:
    with _lock(path):
        write_bytes_atomic(path, bytes(cache.serialize()))
