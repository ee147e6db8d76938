"""The pass registry: name -> (function, typed params, one-sentence description).

A plain dict so a reader sees every pass in one place. A pass is ``fn(graph, params) -> int``: it rewrites
the onnx-graphsurgeon graph in place and returns how many rewrites it made (0 = nothing matched).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import onnx_graphsurgeon as gs
from pydantic import BaseModel, ConfigDict, ValidationError

from kiln.core.errors import ConfigError


class NoParams(BaseModel):
    """Params of a pass that takes none (unknown keys are rejected)."""

    model_config = ConfigDict(extra="forbid")


PassFn = Callable[[gs.Graph, Any], int]


@dataclass(frozen=True)
class PassSpec:
    name: str
    fn: PassFn
    params: type[BaseModel]
    description: str


PASSES: dict[str, PassSpec] = {}


def register(name: str, params: type[BaseModel] = NoParams) -> Callable[[PassFn], PassFn]:
    """Decorator: register ``fn`` under ``name``; its docstring's first line is the description."""

    def wrap(fn: PassFn) -> PassFn:
        doc = (fn.__doc__ or "").strip().splitlines()
        PASSES[name] = PassSpec(name, fn, params, doc[0] if doc else name)
        return fn

    return wrap


def _load() -> dict[str, PassSpec]:
    # Importing the families fills PASSES; done lazily so the config module stays light.
    from kiln.stages.optimize.passes import eliminate, fold, fuse_linear, patterns, qkv, shapes  # noqa: F401

    return PASSES


def available() -> list[str]:
    return sorted(_load())


def resolve(entry: str | dict[str, Any]) -> tuple[PassSpec, BaseModel]:
    """A config entry (a name, or ``{name: ..., <params>}``) -> the pass and its validated params."""
    passes = _load()
    if isinstance(entry, str):
        name, raw = entry, {}
    elif isinstance(entry, dict) and isinstance(entry.get("name"), str):
        raw = {k: v for k, v in entry.items() if k != "name"}
        name = entry["name"]
    else:
        raise ConfigError(f"optimize.passes entry {entry!r} is neither a pass name nor a mapping with 'name'",
                          hint="write e.g. `- fold_constants` or `- {name: merge_qkv, min_branches: 2}`")
    if name not in passes:
        raise ConfigError(f"unknown optimize pass '{name}'", hint=f"available passes: {', '.join(sorted(passes))}")
    spec = passes[name]
    try:
        params = spec.params(**raw)
    except ValidationError as exc:
        fields = ", ".join(spec.params.model_fields) or "none"
        raise ConfigError(f"bad params for optimize pass '{name}': {str(exc).splitlines()[1:3]}",
                          hint=f"params of '{name}': {fields}") from None
    return spec, params


def describe() -> dict[str, str]:
    """Pass name -> one-sentence description (for `kiln config` and the docs)."""
    return {n: s.description for n, s in sorted(_load().items())}
