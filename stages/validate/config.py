"""The ``validate:`` config section: batch sizes, timing, and the gates an engine must pass."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator

from kiln.core.sections import AutoOnOff, Section
from kiln.stages.precision.config import PRECISIONS


def _default_per_precision() -> dict[str, dict[str, float]]:
    return {
        "fp16": {"min_cosine": 0.999},
        "int8": {"min_cosine": 0.99, "min_top1_agreement": 0.97, "max_accuracy_drop": 0.02},
    }


class GatesConfig(Section):
    min_cosine: float = Field(
        0.9999,
        ge=-1.0,
        le=1.0,
        description="cosine similarity of the logits output, flattened, vs PyTorch (kiln.core.compare 'cosine')",
    )
    max_abs_err: float | None = Field(None, ge=0, description="max abs output error vs PyTorch; null = unchecked")
    min_top1_agreement: float = Field(
        0.99, ge=0, le=1.0, description="fraction of samples whose argmax matches PyTorch"
    )
    max_accuracy_drop: float = Field(
        0.01, ge=0, le=1.0, description="allowed task-accuracy drop vs PyTorch (0.01 = 1 point)"
    )
    max_latency_p50_ms: float | None = Field(None, gt=0, description="latency budget at the largest batch size")
    # Reduced precisions get their own looser defaults: FP16/INT8 cannot match FP32 to 1e-4.
    per_precision: dict[str, dict[str, float]] = Field(
        default_factory=lambda: _default_per_precision(),
        description="overrides of the gates above per precision, merged into these defaults gate by gate",
    )

    @field_validator("per_precision", mode="before")
    @classmethod
    def _merge_with_defaults(cls, value: Any) -> Any:
        # Relaxing one gate must not drop the other defaults (which would tighten them to the FP32 gates).
        if not isinstance(value, dict):
            return value  # pydantic reports the type error
        merged: dict[str, Any] = _default_per_precision()
        for precision, overrides in value.items():
            both = isinstance(overrides, dict) and isinstance(merged.get(precision), dict)
            merged[precision] = {**merged[precision], **overrides} if both else overrides
        return merged

    @field_validator("per_precision")
    @classmethod
    def _known_overrides(cls, value: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
        # A dict of dicts escapes the strict section check: a misspelt gate would be silently ignored.
        gates = sorted(set(cls.model_fields) - {"per_precision"})
        for precision, overrides in value.items():
            if precision not in PRECISIONS:
                raise ValueError(f"unknown precision '{precision}' (valid: {', '.join(PRECISIONS)})")
            unknown = sorted(set(overrides) - set(gates))
            if unknown:
                raise ValueError(f"unknown gate {unknown} for {precision} (valid gates: {', '.join(gates)})")
            for gate, limit in overrides.items():  # the same bounds as the gate itself (a plain dict escapes them)
                try:
                    cls.model_validate({gate: limit})
                except ValidationError as exc:
                    raise ValueError(f"{precision}.{gate}: {exc.errors()[0]['msg']} (got {limit!r})") from None
        return value


class ValidateConfig(Section):
    warmup: int = Field(5, ge=0)
    iterations: int = Field(30, ge=1, description="timed calls per engine and batch size, at most")
    time_budget_s: float = Field(
        3.0,
        gt=0,
        description="seconds of timed calls per engine (or baseline) and batch size: fewer calls than iterations "
        "once spent (at least 3), and a CPU warm-up of a quarter of it at most, so a large batch on a slow device "
        "does not time for minutes",
    )
    cpu_baseline: AutoOnOff = Field(
        "auto",
        description="time PyTorch on the CPU as a baseline: auto = when an engine runs on the CPU (GPU engines are "
        "timed against PyTorch on their GPU; the accuracy reference is computed on the CPU either way)",
    )
    max_samples: int | None = Field(None, ge=1, description="cap on held-out samples used for accuracy")
    gates: GatesConfig = Field(default_factory=GatesConfig)
    baselines: list[Literal["eager", "compile"]] = Field(
        default_factory=lambda: ["eager"],
        min_length=1,
        description="PyTorch baselines timed on each engine's device: eager, and/or compile (torch.compile;"
        " max-autotune on a GPU, default mode on the CPU)",
    )
    baseline_precisions: list[Literal["fp32", "fp16"]] = Field(
        default_factory=lambda: ["fp32"],
        min_length=1,
        description="precisions of the GPU baselines (fp16: model.half(); CPU baselines are always fp32)",
    )
    choice_margin: float = Field(
        0.03,
        ge=0,
        lt=1,
        description="per batch, the chosen engine is the fastest that passes its gates; an engine"
        " listed earlier (TensorRT first) keeps the choice unless a later one is"
        " faster by more than this fraction (timing noise is no reason to switch)",
    )
