"""Settings of the build stage."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from pipeline.sections import Section


class OnnxRuntimeConfig(Section):
    devices: list[Literal["cpu", "cuda"]] = Field(default_factory=lambda: ["cpu"])
    intra_op_threads: int = Field(0, ge=0, description="0 = one per physical core")


class TensorRTConfig(Section):
    enabled: Literal["auto", "always", "never"] = Field(
        "auto", description="auto builds when tensorrt or tensorrt_rtx imports; always fails if neither does")
    optimization_level: int = Field(3, ge=0, le=5)
    workspace_mb: int = Field(1024, ge=16)


class BuildConfig(Section):
    backends: list[Literal["onnxruntime", "tensorrt"]] = Field(default_factory=lambda: ["onnxruntime", "tensorrt"])
    onnxruntime: OnnxRuntimeConfig = Field(default_factory=OnnxRuntimeConfig)
    tensorrt: TensorRTConfig = Field(default_factory=TensorRTConfig)
