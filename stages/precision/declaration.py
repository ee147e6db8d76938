"""The precision stage as the pipeline sees it: what it reads, what it returns, its report section and its cache
key's environment. Torch-free and ONNX-free, so a run that finds the stage cached loads neither."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import Field

from kiln.calibration.config import CalibrationConfig
from kiln.core.cpu_int8 import resolve_reduce_range
from kiln.core.env import environment_subset
from kiln.core.signature import Signature
from kiln.core.stage import Stage, StageSettings, Summary
from kiln.models.config import DataConfig, ModelConfig
from kiln.stages.accuracy.config import CheckConfig, GatesConfig
from kiln.stages.precision.config import PrecisionConfig
from kiln.stages.precision.report import report_section

# Gates only validation reads (it times engines; precision makes graphs): left out of precision's key, so changing
# them reruns validation alone
VALIDATE_ONLY_GATES = ("max_latency_p50_ms",)
PRECISION_GATES = tuple(f"validate.gates.{g}" for g in GatesConfig.model_fields if g not in VALIDATE_ONLY_GATES)


def variant_gates(settings: PrecisionSettings) -> dict[str, dict[str, Any]]:
    """The gates each variant precision judges is held to, by precision (:meth:`GatesConfig.of_precision`, as
    validation holds its engines to them). The FP32 variant is the optimized graph itself, judged by no gate here:
    its gates are validation's alone."""
    return {p: settings.gates.of_precision(p) for p in dict.fromkeys(settings.precision.variants) if p != "fp32"}


@dataclass(frozen=True)
class PrecisionSettings(StageSettings):
    """What the precision stage reads: its section and calibration's, the data it calibrates and checks
    variants on (with the model and seed that make it), the signature (logits output, dynamic axes), and which
    engines load its graphs."""

    SOURCES = {
        "signature": (
            "signature.dynamic_axes",
            "signature.shapes",
            "signature.logits_output",
            "signature.batch_sizes",
        ),
        "graph_readers": "build.graph_readers",
        "graph_engines": "build.graph_engines",
        # validation's accuracy gates, metric and held-out data: a variant is accepted by the check its engines will
        # face (read together as ``validate``)
        "gates": PRECISION_GATES,
        "held_out": ("validate.metric", "validate.metric_higher_is_better", "validate.max_samples"),
    }
    # the key holds the gates as each variant made is held to them (:func:`variant_gates`), not the raw section: a
    # gate no variant of the run reads (the FP32 one, where FP16 and INT8 have their own) leaves precision cached
    KEY_VIEWS: ClassVar[dict[str, Callable[[Any], Any]]] = {"gates": variant_gates}
    seed: int
    model: ModelConfig
    data: DataConfig
    precision: PrecisionConfig
    calibration: CalibrationConfig
    signature: Signature
    graph_readers: list[str]  # the configured backends that build from ONNX graphs: none, no graph is converted
    # their engines as <backend>-<device>: where onnxruntime-cpu alone loads INT8 graphs, the Q/DQ graph is no
    # engine's and only ONNX Runtime CPU's own graph is searched (kiln.stages.precision.variants.build_int8)
    graph_engines: list[str]
    gates: GatesConfig
    held_out: CheckConfig

    @property
    def validate(self) -> CheckConfig:
        """The accuracy check as validation applies it to engines, with the gates precision reads (a view of
        ``validate:`` whose gates leave out :data:`VALIDATE_ONLY_GATES`)."""
        return self.held_out.model_copy(update={"gates": self.gates})


class PrecisionSummary(Summary):
    """Per variant made, what it kept in FP32 (and the PyTorch modules those nodes came from) and how it compares
    with FP32; the variants that failed and why; the per-node error plot and each variant's first divergence."""

    variants: dict[str, dict[str, Any]] = Field(default_factory=dict)
    failed: dict[str, str] = Field(default_factory=dict)
    node_error_plot: str | None = None
    first_divergence: dict[str, Any] | None = None
    node_error_threshold: float | None = None
    node_errors_skipped: str | None = None
    calibration_cache: str | None = None


def _env(cfg: PrecisionSettings) -> dict[str, Any]:
    # reduce_range auto depends on the CPU: the same config quantizes differently on another machine
    return {
        **environment_subset("onnx", "onnx-graphsurgeon", "onnxruntime"),
        "int8_reduce_range": resolve_reduce_range(cfg.calibration.reduce_range),
    }


STAGE = Stage(
    "precision",
    "kiln.stages.precision.stage:run",
    ("optimize", "train"),
    PrecisionSettings,
    PrecisionSummary,
    ("kiln.stages.precision", "kiln.calibration", "kiln.stages.accuracy"),
    _env,
    "FP16 mixed precision and INT8 (Q/DQ) graphs",
    data=("dataset", "calibration"),
    report=report_section,
    checks=("kiln.calibration.data:check_reader", "kiln.stages.accuracy.metrics:check_metric"),
)
