"""What an ONNX Runtime engine records about its build (``kiln-engine.json`` "backend_info")."""

from __future__ import annotations

from typing import Any

from kiln.core.records import Part


class OrtRecord(Part):
    """The session the runner opens (providers, threads, optimization levels), whether it captures CUDA graphs,
    and the autotuner's trials and choices."""

    session: dict[str, Any]
    cuda_graph: bool = False
    autotune: dict[str, Any] | None = None
