"""Engines a rerun of the build stage keeps from its previous output: an engine whose own inputs are unchanged is
copied from the build folder this run replaces, not built again.

A stage reruns as a whole when anything in its key changes (a precision variant's graph, another backend's
setting), but each engine reads only part of it. :func:`inputs_key` hashes that part; the engine's
``kiln-engine.json`` records it (``settings_hash``), so :meth:`PreviousBuild.take` can tell an engine of the
previous run that this run would build from the same inputs. The previous folder stays in place until the runner
swaps in the new one (:func:`kiln.core.artifacts.atomic_dir`): a run cut off while copying loses nothing.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kiln.calibration.feeds import FILE as FEEDS_FILE
from kiln.core.artifacts import atomic_dir, hash_file, hash_json, hash_tree, read_manifest
from kiln.core.env import version
from kiln.core.errors import KilnError
from kiln.core.onnx_io import onnx_files
from kiln.core.stage import StageContext
from kiln.stages.engines.backend import SIDECAR, Backend, read_metadata

# The precisions whose engines may calibrate themselves on the precision stage's batches (the torch backend's
# FP8/INT8 scales): only their keys hold those batches, which a change of calibration settings alone changes.
CALIBRATED = ("int8", "fp8")


def inputs_key(
    ctx: StageContext[Any],
    backend: Backend,
    device: str,
    precision: str,
    graphs: list[Path],
    keep_fp32: list[str] | None,
    shapes: Mapping[str, Any],
) -> str | None:
    """The hash of everything one engine is built from: the bytes of the ONNX ``graphs`` it may be built from
    (with their external weights), its backend, device and precision, the backend's section of the build config
    and the files it names, ``keep_fp32``, the ``shapes`` it is sized for (largest batch, axis sizes and steps,
    integer ranges), Kiln's build code and version, and the versions of the libraries its backend depends on.
    A backend that compiles the PyTorch model adds the trained weights, the model's config and code; an engine of
    a calibrated precision, the calibration batches. None outside the runner (no key parts): nothing is reused."""
    parts = ctx.key_parts
    if not parts:
        return None
    try:
        graph_hashes = [[f.name, hash_file(f)] for graph in graphs for f in onnx_files(graph)]
    except KilnError:  # a missing or broken graph: its build says so
        return None
    settings = backend.settings(ctx.config.build).model_dump(mode="json")
    env = dict(parts.get("env") or {})
    libraries = ("onnx", *backend.libraries)
    env["versions"] = {k: v for k, v in (env.get("versions") or {}).items() if k in libraries}
    key: dict[str, Any] = {
        "engine": [backend.name, device, precision],
        "graphs": graph_hashes,
        "keep_fp32": sorted(keep_fp32 or []),
        "settings": settings,
        "setting_files": _named_files(settings),
        "shapes": dict(shapes),
        "kiln": [parts.get("code"), version("kiln")],
        "env": env,
    }
    if not backend.reads_graph:  # compiles the trained PyTorch model itself
        key["model"] = [(parts.get("inputs") or {}).get("train"), (parts.get("config") or {}).get("model")]
        key["user_code"] = parts.get("user_code")
    calibration = ctx.inputs["precision"] / FEEDS_FILE if "precision" in ctx.inputs else None
    if precision in CALIBRATED and calibration is not None and calibration.is_file():
        key["calibration"] = hash_file(calibration)
    return hash_json(key)


def _named_files(value: Any) -> dict[str, str]:
    """The sha256 of each existing file a setting names (TensorRT's ``calibration_cache``): the engine reads it."""
    if isinstance(value, dict):
        return {k: v for item in value.values() for k, v in _named_files(item).items()}
    if isinstance(value, list):
        return {k: v for item in value for k, v in _named_files(item).items()}
    if isinstance(value, str) and value and os.path.isfile(value):  # False, not an error, for any odd string
        return {value: hash_file(Path(value))}
    return {}


class PreviousBuild:
    """The build stage's folder as the previous run finished it (``<workdir>/build``, which the running stage
    replaces only once it is done), with the file hashes and summary its manifest recorded. A forced rerun
    (``--force build``, ``forced``) or one whose stage key is the previous one's (files damaged since) keeps nothing:
    it rebuilds every engine."""

    def __init__(self, folder: Path, key_parts: dict[str, Any], log: logging.Logger, forced: bool = False) -> None:
        manifest = read_manifest(folder) or {}
        self.folder, self.log = folder, log
        forced = forced or manifest.get("key_parts") == key_parts
        self.outputs: dict[str, str] = {} if forced else manifest.get("outputs") or {}
        engines = (manifest.get("summary") or {}).get("engines")
        self.entries = {e.get("name"): e for e in engines if isinstance(e, dict)} if isinstance(engines, list) else {}

    def take(self, name: str, key: str | None, out: Path) -> dict[str, Any] | None:
        """Copy engine ``name`` into ``out`` where the previous build made it from inputs of hash ``key`` and its
        files are still the bytes that build recorded; returns its summary entry (``reused``), else None."""
        listed = self._listed(name)
        if key is None or SIDECAR not in listed or name not in self.entries:
            return None
        source = self.folder / name
        try:
            if read_metadata(source).settings_hash != key:
                return None
        except KilnError:
            return None
        try:
            with atomic_dir(out) as staging:
                shutil.copytree(source, staging, dirs_exist_ok=True)
                if hash_tree(staging) != listed:  # changed, added or removed since that build recorded them
                    raise _Changed
        except (_Changed, OSError):
            self.log.debug("engine %s: the previous build's files changed since it ran: building it again", name)
            return None
        self.log.info("engine %s: inputs unchanged, kept from the previous build", name)
        return {**self.entries[name], "reused": True}

    def _listed(self, name: str) -> dict[str, str]:
        """The previous manifest's hashes of engine ``name``'s files, by path inside its folder."""
        prefix = f"{name}/"
        return {rel.removeprefix(prefix): h for rel, h in self.outputs.items() if rel.startswith(prefix)}


class _Changed(Exception):
    """The previous engine's files are not those its build recorded (raised to drop the partial copy)."""
