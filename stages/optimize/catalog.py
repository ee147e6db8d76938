"""Every registered pass, and the look-ups config and the optimizer make: ``resolve`` a config entry,
``available`` names, ``describe`` them. Importing this module imports every pass family."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from kiln.core.errors import ConfigError
from kiln.stages.optimize.passes import (  # noqa: F401 (importing registers)
    eliminate,
    fold,
    fuse_linear,
    patterns,
    qkv,
    sequences,
    shapes,
)
from kiln.stages.optimize.registry import PASSES, PassSpec


def available() -> list[str]:
    return sorted(PASSES)


def resolve(entry: str | dict[str, Any]) -> tuple[PassSpec, BaseModel]:
    """A config entry (a name, or ``{name: ..., <params>}``) -> the pass and its validated params."""
    passes = PASSES
    if isinstance(entry, str):
        name, raw = entry, {}
    elif isinstance(entry, dict) and isinstance(entry.get("name"), str):
        raw = {k: v for k, v in entry.items() if k != "name"}
        name = entry["name"]
    else:
        raise ConfigError(
            f"optimize.passes entry {entry!r} is neither a pass name nor a mapping with 'name'",
            hint="write e.g. `- fold_constants` or `- {name: merge_qkv, min_branches: 2}`",
        )
    if name not in passes:
        raise ConfigError(f"unknown optimize pass '{name}'", hint=f"available passes: {', '.join(sorted(passes))}")
    spec = passes[name]
    try:
        params = spec.params(**raw)
    except ValidationError as exc:
        fields = ", ".join(spec.params.model_fields) or "none"
        raise ConfigError(
            f"bad params for optimize pass '{name}': {str(exc).splitlines()[1:3]}", hint=f"params of '{name}': {fields}"
        ) from None
    return spec, params


def describe() -> dict[str, str]:
    """Pass name -> one-sentence description (for `kiln config` and the docs)."""
    return {n: s.description for n, s in sorted(PASSES.items())}
