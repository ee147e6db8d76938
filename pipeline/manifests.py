"""A stage folder's ``manifest.json``, read without the runner (``kiln serve`` checks a workdir's package with it,
and loads none of the pipeline)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kiln.core.artifacts import hash_json

MANIFEST = "manifest.json"


def read_manifest(stage_dir: Path) -> dict[str, Any] | None:
    """The stage's manifest, or None when it is missing, unreadable or not the shape Kiln writes (a damaged
    manifest means the stage is redone, never trusted)."""
    try:
        m = json.loads((stage_dir / MANIFEST).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    ok = (
        isinstance(m, dict)
        and isinstance(m.get("key"), str)
        and isinstance(m.get("outputs"), dict)
        and isinstance(m.get("sizes", {}), dict)
        and isinstance(m.get("key_parts", {}), dict)
        and isinstance(m.get("summary", {}), dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in m["outputs"].items())
    )
    return m if ok else None


def changed_inputs(workdir: Path, stage: str) -> list[str]:
    """The upstream stages whose outputs in ``workdir`` are not those ``stage`` last ran on (its manifest's key
    parts): its folder is then from an earlier run, e.g. a package kept after a later run's gates failed."""
    own = read_manifest(workdir / stage)
    if own is None:
        return []
    out = []
    for up, recorded in (own.get("key_parts", {}).get("inputs") or {}).items():
        m = read_manifest(workdir / up)
        if m is not None and hash_json(m["outputs"]) != recorded:  # one removed since (to save space) is no sign
            out.append(up)
    return out
