"""The ordered list of pipeline stages. Each stage module defines its own :class:`~kiln.core.stage.Stage` (what it
reads, which config it depends on, its code, its report section); this is only their order."""

from __future__ import annotations

from kiln.core.errors import ConfigError
from kiln.core.stage import Stage
from kiln.stages import export
from kiln.stages.engines import stage as build
from kiln.stages.optimize import stage as optimize
from kiln.stages.package import stage as package
from kiln.stages.precision import stage as precision
from kiln.stages.train import stage as train
from kiln.stages.validate import stage as validate

STAGES: list[Stage] = [
    train.STAGE,
    export.STAGE,
    optimize.STAGE,
    precision.STAGE,
    build.STAGE,
    validate.STAGE,
    package.STAGE,
]
STAGE_NAMES = [s.name for s in STAGES]


def stage_named(name: str) -> Stage:
    for s in STAGES:
        if s.name == name:
            return s
    raise ConfigError(f"unknown stage '{name}'", hint=f"use one of {', '.join(STAGE_NAMES)}")
