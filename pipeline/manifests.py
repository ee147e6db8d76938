"""A stage folder's ``manifest.json``, read without the runner (``kiln serve`` checks a workdir's package with it,
and loads none of the pipeline)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.core.artifacts import hash_json, read_manifest


def handed_on(m: dict[str, Any]) -> str:
    """The hash of what a stage's manifest says it hands to later stages: its outputs but its notes (files for
    people, which no later stage reads), the part of a later stage's key that stands for it."""
    notes = set(m.get("notes", ()))
    return hash_json({k: v for k, v in m["outputs"].items() if k not in notes})


def changed_inputs(workdir: Path, stage: str) -> list[str]:
    """The upstream stages whose outputs in ``workdir`` are not those ``stage`` last ran on (its manifest's key
    parts): its folder is then from an earlier run, e.g. a package kept after a later run's gates failed."""
    own = read_manifest(workdir / stage)
    if own is None:
        return []
    inputs = own.get("key_parts", {}).get("inputs")
    out = []
    for up, recorded in (inputs if isinstance(inputs, dict) else {}).items():
        m = read_manifest(workdir / up)
        if m is not None and handed_on(m) != recorded:  # one removed since (to save space) is no sign
            out.append(up)
    return out


def out_of_date(workdir: Path, stage: str) -> list[tuple[str, list[str]]]:
    """The stages ``stage``'s folder was made from, directly or further up the chain its manifests record (itself
    included), that ran on other outputs of their own upstream stages than those now in ``workdir``
    (:func:`changed_inputs`, what the report calls stale), each with those upstream stages, earliest in the
    pipeline first; empty when it is current. A build is out of date when the precision it recorded was made anew
    since, and also when that precision was made from an export made anew since (the build then has old engines)."""
    depth: dict[str, int] = {}
    found: dict[str, list[str]] = {}

    def visit(name: str) -> int:
        if name not in depth:
            depth[name] = 0  # a cycle in damaged manifests ends here
            recorded = ((read_manifest(workdir / name) or {}).get("key_parts") or {}).get("inputs")
            ups = list(recorded) if isinstance(recorded, dict) else []
            depth[name] = 1 + max((visit(up) for up in ups), default=-1)  # its place in the pipeline
            if changed := changed_inputs(workdir, name):
                found[name] = sorted(changed, key=lambda up: depth.get(up, 0))
        return depth[name]

    visit(stage)
    return sorted(found.items(), key=lambda item: depth[item[0]])
