"""The ``validate:`` config section: timing and baselines, on top of the check it shares with the precision stage
(:class:`kiln.stages.accuracy.config.CheckConfig`: gates, metric, held-out samples)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kiln.core.sections import AutoOnOff
from kiln.stages.accuracy.config import CheckConfig


class ValidateConfig(CheckConfig):
    warmup: int = Field(5, ge=0)
    iterations: int = Field(
        30,
        ge=1,
        description="timed calls per engine, batch size and round, at most (fewer once the round's share of "
        "time_budget_s is spent): many quick calls per round, one slow one",
    )
    roofline: bool = Field(
        True,
        description="put each engine's achieved TFLOP/s beside its device's GEMM peak (measured once per device, "
        "cached in the workdir's cache)",
    )
    rounds: int = Field(
        12,
        ge=1,
        description="interleaved timing rounds: every engine and baseline is timed in turn, round after round (at "
        "least 6, the fewest that give a 95 % interval of the median; from 12 the interval drops the outermost "
        "rounds), in blocks of up to `iterations` calls",
    )
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
