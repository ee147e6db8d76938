"""What a TensorRT engine records about its build (``kiln-engine.json`` "backend_info")."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from kiln.core.records import Part


class TensorRTRecord(Part):
    """The library's features, typing mode, the GPU it targets, its optimization profiles, timing- and runtime-cache
    use, and whether the runner captures CUDA graphs."""

    features: dict[str, bool] = Field(default_factory=dict)
    strongly_typed: bool | None = None
    target: dict[str, Any] = Field(default_factory=dict)
    profiles: list[dict[str, Any]] = Field(default_factory=list)
    timing_cache: dict[str, Any] | None = None
    runtime_cache: str | None = None
    cuda_graph: bool = False
