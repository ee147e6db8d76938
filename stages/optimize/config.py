"""Settings of the optimize stage."""
from __future__ import annotations

from pydantic import Field

from pipeline.sections import Section

DEFAULT_PASSES = ["fold_constants", "cleanup", "toposort"]


class OptimizeConfig(Section):
    passes: list[str] = Field(default_factory=lambda: list(DEFAULT_PASSES), description="graph passes, in order")
    verify: bool = Field(True, description="check each pass keeps the graph's function; roll back if not")
