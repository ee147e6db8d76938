"""The build's check that an ONNX Runtime engine loads the way its runner will load it, and the fallbacks.

The engine file is the graph ORT optimized offline; the runner opens it with the session recorded for it, whose
``load_optimization`` lets ORT optimize it once more (the host-specific passes). ORT cannot always optimize a
graph it optimized itself: a pass that adds an initializer under a fixed name finds the name taken by what the
same pass added offline, and the session fails ("Attempt to replace the existing tensor"). So the build opens the
file as recorded (one session creation, which a CPU autotune reuses for its first candidate) and, where that
fails, records the first of these that opens: the same file at a lower load level, then the graph before
ORT's offline optimization, which ORT optimizes in one go at load. Nothing opening is one BuildError.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

from kiln.core.errors import BuildError
from kiln.core.onnx_io import ort_session
from kiln.stages.engines.onnxruntime.runner import providers_of, session_options, session_refusal

log = logging.getLogger("kiln.build")
LOAD_LEVELS = ("all", "extended", "basic", "none")  # most optimization first


@dataclass
class Loaded:
    """How the engine file opens: the offline level it holds and the load level it opened at; ``fallback`` (for
    the engine's record) when that is not what was asked; ``session``: the session the check opened."""

    offline: str
    load: str
    fallback: dict[str, str] | None = None
    session: Any = None


def open_file(path: Path, settings: dict[str, Any], level: str) -> tuple[Any, str | None]:
    """``(session, None)`` when ORT opens ``path`` as the runner does with these session ``settings`` at load
    level ``level``; else ``(None, ORT's reason on one line)``."""
    try:
        options = session_options({**settings, "load_optimization": level})
        return ort_session(path, providers=providers_of(settings), options=options, error=BuildError), None
    except BuildError as exc:
        return None, session_refusal(exc)


def settle_load(
    path: Path,
    settings: dict[str, Any],
    unoptimized: Callable[[], onnx.ModelProto],
    name: str,
    lower: bool = True,
) -> Loaded:
    """Open the engine file at ``path`` with its recorded ``settings`` (``offline_optimization``,
    ``load_optimization``, threads, providers). If ORT refuses: the file at the next lower load level that opens
    (only with ``lower``: one level serves every file of an engine), else ``unoptimized()`` written over it and
    opened at the recorded level; else a BuildError naming ORT's reason."""
    wanted, offline = settings["load_optimization"], settings["offline_optimization"]
    session, why = open_file(path, settings, wanted)
    if session is not None:
        return Loaded(offline, wanted, session=session)
    for level in LOAD_LEVELS[LOAD_LEVELS.index(wanted) + 1 :] if lower else ():
        session, _ = open_file(path, settings, level)
        if session is not None:
            return _fell_back(name, path, wanted, why, Loaded(offline, level, session=session))
    if offline != "none":
        onnx.save(unoptimized(), str(path))
        session, _ = open_file(path, settings, wanted)
        if session is not None:
            return _fell_back(name, path, wanted, why, Loaded("none", wanted, session=session))
    raise BuildError(
        f"ONNX Runtime cannot load engine {name} ({path.name}) at load_optimization '{wanted}': {why}",
        hint="ONNX Runtime loads neither the graph it optimized nor the un-optimized one with this engine's "
        "session settings: leave this engine out (build.onnxruntime.devices, or build.backends without "
        "onnxruntime), or build it with another onnxruntime version",
    )


def _fell_back(name: str, path: Path, wanted: str, why: str | None, got: Loaded) -> Loaded:
    """``got``, its fallback said in the log and put in its record."""
    used = (
        f"the un-optimized graph, optimized by ONNX Runtime at load_optimization '{got.load}'"
        if got.offline == "none"
        else f"the offline-optimized graph at load_optimization '{got.load}'"
    )
    log.warning(
        "%s: ONNX Runtime cannot load %s at load_optimization '%s' (%s); the engine is %s",
        name,
        path.name,
        wanted,
        why,
        used,
    )
    got.fallback = {"file": path.name, "load_optimization": wanted, "error": why or "", "engine": used}
    return got
