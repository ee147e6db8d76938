"""The train stage as the pipeline sees it: what it reads, what it returns, its report section and its cache key's
environment. Torch-free, so a run that finds the stage cached does not load torch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import Field

from kiln.core.env import environment_subset
from kiln.core.signature import Signature
from kiln.core.stage import Stage, StageSettings, Summary
from kiln.models.config import DataConfig, ModelConfig
from kiln.stages.train.config import TrainConfig
from kiln.stages.train.report import report_section


@dataclass(frozen=True)
class TrainSettings(StageSettings):
    """What the train stage reads: the model and its data, the training settings and the signature (the
    logits output the loss and accuracy use, the dynamic axes the data may vary in)."""

    SOURCES = {
        "signature": ("signature.dynamic_axes", "signature.logits_output"),
        "gated_outputs": "validate.gates.gated_outputs",
    }
    # gated_outputs is checked against the model's outputs on the pre-training probe (a typo fails in seconds, not
    # after precision), and keys nothing: a gate changed does not retrain
    KEY_VIEWS: ClassVar[dict[str, Callable[[Any], Any]]] = {"gated_outputs": lambda settings: None}
    seed: int
    model: ModelConfig
    data: DataConfig
    train: TrainConfig
    signature: Signature
    gated_outputs: list[str] | None = None


class TrainSummary(Summary):
    """The training run (:meth:`kiln.stages.train.metrics.TrainResult.summary`), or why there was none
    (``status: skipped``, ``source``: the checkpoint, the initial weights or the ONNX file taken instead)."""

    precision: str | None = None
    device: str | None = None
    world_size: int | None = None
    steps: int | None = None
    epochs: list[dict[str, Any]] = Field(default_factory=list)
    final_loss: float | None = None
    val_accuracy: float | None = None
    val_loss: float | None = None
    selected_epoch: int | None = None
    best_val_accuracy: float | None = None
    best_epoch: int | None = None
    best_val_loss: float | None = None
    best_by: str | None = None
    skipped_steps: int = 0
    nonfinite_steps: int = 0
    samples_per_s: float | None = None
    peak_memory_mb: float | None = None
    resumed_from: str | None = None
    checkpoint_dir: str | None = None
    fp32_norm_layers: int = 0
    compile: dict[str, Any] | None = None
    update_graph: dict[str, Any] | None = None
    # what the checks of the data against the task warned of (one-hot labels, labels that copy an input or sit on
    # padding): the report repeats them where its accuracy is read
    data_warnings: list[str] = Field(default_factory=list)
    files: list[str] = Field(default_factory=list)
    source: str | None = None


def _env(cfg: TrainSettings) -> dict[str, Any]:
    return environment_subset("torch", device=True)


STAGE = Stage(
    "train",
    "kiln.stages.train.stage:run",
    (),
    TrainSettings,
    TrainSummary,
    ("kiln.stages.train", "kiln.models"),
    _env,
    "train the model (AMP, gradient accumulation) or load a checkpoint",
    data=("dataset", "checkpoint", "model_files"),
    report=report_section,
    random_inputs=False,  # without a PyTorch model (random inputs of model.onnx) nothing is trained
    notes=("loss.png", "trace.json"),  # train.plot or a profile toggled: the weights, not these, go on
)
