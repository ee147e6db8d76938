"""The ordered list of pipeline stages. Each stage module defines its own :class:`~kiln.core.stage.Stage` (what it
reads, which config it depends on, its code, its report section); this is only their order.

The names are listed here and the stage modules, which import the libraries their stages run (torch, ONNX, ONNX
Runtime), load when ``STAGES`` is first read: ``kiln --help`` and reading a config need the names only.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kiln.core.errors import ConfigError

if TYPE_CHECKING:
    from kiln.core.stage import Stage

STAGE_NAMES = ["train", "export", "optimize", "precision", "build", "validate", "package"]
MODULES = {
    "train": "kiln.stages.train.stage",
    "export": "kiln.stages.export.stage",
    "optimize": "kiln.stages.optimize.stage",
    "precision": "kiln.stages.precision.stage",
    "build": "kiln.stages.engines.stage",
    "validate": "kiln.stages.validate.stage",
    "package": "kiln.stages.package.stage",
}


def __getattr__(name: str) -> Any:
    if name == "STAGES":  # every stage, in order, loaded on first use and kept
        stages = [importlib.import_module(MODULES[n]).STAGE for n in STAGE_NAMES]
        globals()["STAGES"] = stages
        return stages
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def stage_named(name: str) -> Stage:
    if name not in STAGE_NAMES:
        raise ConfigError(f"unknown stage '{name}'", hint=f"use one of {', '.join(STAGE_NAMES)}")
    return importlib.import_module(MODULES[name]).STAGE
