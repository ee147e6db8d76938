"""``build.tensorrt``: the TensorRT builder's settings, optimization profiles and RTX targets."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from kiln.core.sections import Section, bool_words


class ShapeRange(Section):
    """One input's shapes in a TensorRT optimization profile (full shapes, batch axis included)."""

    min: list[int]
    opt: list[int]
    max: list[int]

    @model_validator(mode="after")
    def _ordered(self) -> ShapeRange:
        if not (len(self.min) == len(self.opt) == len(self.max)):
            raise ValueError(f"min/opt/max must have the same rank, got {self.min}, {self.opt}, {self.max}")
        if any(not (a <= b <= c) for a, b, c in zip(self.min, self.opt, self.max)):
            raise ValueError(f"need min <= opt <= max on every axis, got {self.min}, {self.opt}, {self.max}")
        # TensorRT takes empty tensors (a decoder's empty past); an empty batch is refused where the batch is known
        if any(d < 0 for d in self.min):
            raise ValueError(f"shape dims must be >= 0, got min {self.min}")
        return self


class TensorRTConfig(Section):
    enabled: Annotated[Literal["auto", "always", "never"], bool_words("always", "never")] = Field(
        "auto", description="auto builds when tensorrt or tensorrt_rtx imports; always fails if neither does"
    )
    optimization_level: int = Field(3, ge=0, le=5, description="builder optimization level: higher tunes longer")
    workspace_mb: int = Field(1024, ge=16, description="WORKSPACE memory-pool limit")
    tactic_shared_memory_kb: int | None = Field(None, ge=0, description="TACTIC_SHARED_MEMORY pool limit")
    tactic_sources: list[str] | None = Field(
        None,
        description="TacticSource names to allow (e.g. [CUBLAS, CUDNN, EDGE_MASK_CONVOLUTIONS,"
        " JIT_CONVOLUTIONS]); null = library default",
    )
    avg_timing_iterations: int | None = Field(None, ge=1, description="timing runs averaged per tactic; null = default")
    timing_cache: bool = Field(True, description="load the timing cache before each build and save it after")
    max_aux_streams: int | None = Field(
        None, ge=0, description="0 = a single stream: friendlier to CUDA-graph capture; null = builder decides"
    )
    cuda_graph: bool = Field(
        True,
        description="the runner captures a CUDA graph per input shape (TensorRT 10/11);"
        " TensorRT-RTX uses its runtime CUDA-graph strategy",
    )
    compute_capabilities: list[str] = Field(
        default_factory=list,
        description="TensorRT-RTX targets, e.g. [SM89, SM120] or [CURRENT]; empty = library"
        " default. Lets a CPU machine build for a GPU it does not have",
    )
    profiles: list[dict[str, ShapeRange]] = Field(
        default_factory=list,
        description="optimization profiles: input name -> {min, opt, max}; empty = one profile"
        " with dynamic batch 1..max(signature.batch_sizes)",
    )
    calibration_cache: str | None = Field(
        None, description="TensorRT 10 INT8 only: calibration cache file read by the entropy calibrator"
    )
    fp32_op_types: list[str] = Field(
        default_factory=lambda: ["LayerNormalization", "Softmax", "Reduce", "Normalization"],
        description="TensorRT 10 weakly typed only: layers whose name/type contains these stay FP32",
    )
    detailed_profiling: bool = Field(True, description="DETAILED profiling verbosity: richer inspector layer info")

    @field_validator("compute_capabilities")
    @classmethod
    def _upper(cls, v: list[str]) -> list[str]:
        return [c.upper() for c in v]
