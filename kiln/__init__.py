"""Kiln: turn a PyTorch model into a validated, serving-ready inference engine.

The user-facing API is importable from here; each name loads its module on first use (PEP 562), so
``import kiln`` is cheap and needs neither TensorRT nor onnxruntime-gpu::

    from kiln import DatasetSplits, load_config, run_pipeline, load_engine

    result, report = run_pipeline(load_config("my.yaml"), "kiln-out")
    with load_engine("kiln-out/package/engines/onnxruntime-cpu-fp32") as runner:
        outputs = runner.infer({"input": batch})
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> module that defines it
_EXPORTS = {
    "DatasetSplits": "kiln.core.data",
    "KilnError": "kiln.core.errors",
    "GateFailure": "kiln.core.errors",
    "KilnConfig": "kiln.pipeline.config",
    "load_config": "kiln.pipeline.config",
    "config_from_dict": "kiln.pipeline.config",
    "run_pipeline": "kiln.pipeline.api",
    "load_engine": "kiln.stages.engines.registry",
    "STAGE_NAMES": "kiln.pipeline.stage_list",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kiln' has no attribute '{name}'")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # for type checkers and IDEs only; at run time the names load lazily above  # noqa: F401
    from kiln.core.data import DatasetSplits
    from kiln.core.errors import GateFailure, KilnError
    from kiln.pipeline.api import run_pipeline
    from kiln.pipeline.config import KilnConfig, config_from_dict, load_config
    from kiln.pipeline.stage_list import STAGE_NAMES
    from kiln.stages.engines.registry import load_engine
