"""The validate stage as the pipeline sees it: what it reads, what it returns, its report section and its cache
key's environment. Torch-free and ONNX-free, so a run that finds the stage cached loads neither."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kiln.core.env import environment_subset
from kiln.core.records import ValidationResult
from kiln.core.signature import Signature
from kiln.core.stage import Stage, StageSettings
from kiln.models.config import DataConfig, ModelConfig
from kiln.stages.engines.registry import backend_libraries
from kiln.stages.validate.config import ValidateConfig
from kiln.stages.validate.report import report_section

# how a failure of precision.required starts (a precision the run was asked for and did not deliver)
REQUIRED = "precision.required: "
# how a failure of precision.required says its engines exist but could not run here (validated where they run)
UNVALIDATED = "were built but not validated on this machine"
# how a failure of precision.required says no engine of the precision was built at all (no gate was missed)
NOT_BUILT = "engine was built (the result line says why)"


@dataclass(frozen=True)
class ValidateSettings(StageSettings):
    """What validation reads: its section (timing, gates, baselines), the model and data the reference comes from,
    the signature (batch sizes, shapes, logits output), whether slower reduced precision is dropped and which
    precisions the run must deliver."""

    SOURCES = {"require_speedup": "precision.require_speedup", "required": "precision.required"}
    seed: int
    model: ModelConfig
    data: DataConfig
    validate: ValidateConfig
    signature: Signature
    require_speedup: bool
    required: list[str]


def _env(cfg: ValidateSettings) -> dict[str, Any]:
    return environment_subset("torch", "onnxruntime", *backend_libraries(), device=True)


# Engines run through kiln.stages.engines' runners, and the baseline is built from kiln.models: their code is part
# of the result.
STAGE = Stage(
    "validate",
    "kiln.stages.validate.stage:run",
    ("train", "export", "build"),
    ValidateSettings,
    ValidationResult,
    (
        "kiln.stages.validate",
        "kiln.stages.accuracy",
        "kiln.stages.engines",
        "kiln.models",
        "kiln.models.model_io",
        "kiln.stages.precision.speed",
    ),
    _env,
    "accuracy and latency of every engine vs PyTorch, with gates",
    data=("dataset", "onnx"),
    report=report_section,
    checks=("kiln.stages.accuracy.metrics:check_metric",),
)
