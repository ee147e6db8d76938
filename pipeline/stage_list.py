"""The ordered list of pipeline stages. Each stage's ``declaration`` module defines its
:class:`~kiln.core.stage.Stage` (what it reads, which config it depends on, its code, its report section); this is
only their order.

The declarations load when ``STAGES`` is first read (``kiln --help`` and reading a config need the names only). They
import no torch or ONNX: a stage's own code, which does, loads when the stage runs (``Stage.entry``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kiln.core.errors import ConfigError

if TYPE_CHECKING:
    from kiln.core.stage import Stage

STAGE_NAMES = ["train", "export", "optimize", "precision", "build", "validate", "package"]
MODULES = {
    "train": "kiln.stages.train.declaration",
    "export": "kiln.stages.export.declaration",
    "optimize": "kiln.stages.optimize.declaration",
    "precision": "kiln.stages.precision.declaration",
    "build": "kiln.stages.engines.declaration",
    "validate": "kiln.stages.validate.declaration",
    "package": "kiln.stages.package.declaration",
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
