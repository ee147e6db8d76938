"""The pass registry: name -> (function, typed params, one-sentence description). Pass modules register
into it; ``catalog`` imports them all and looks passes up.

A plain dict so a reader sees every pass in one place. A pass is ``fn(graph, params) -> int``: it rewrites
the onnx-graphsurgeon graph in place and returns how many rewrites it made (0 = nothing matched).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    import onnx_graphsurgeon as gs


class NoParams(BaseModel):
    """Params of a pass that takes none (unknown keys are rejected)."""

    model_config = ConfigDict(extra="forbid")


PassFn = Callable[["gs.Graph", Any], int]


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
