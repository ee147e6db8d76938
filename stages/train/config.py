"""Settings of the train stage."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from pipeline.sections import Section


class TrainConfig(Section):
    enabled: bool = Field(True, description="false skips training (use model.checkpoint or random init)")
    epochs: int = Field(8, ge=1)
    batch_size: int = Field(64, ge=1, description="global batch size per optimizer step")
    grad_accum_steps: int = Field(1, ge=1, description="micro-batches per optimizer step")
    lr: float = Field(3e-3, gt=0)
    weight_decay: float = Field(0.01, ge=0)
    optimizer: Literal["adamw", "sgd"] = "adamw"
    schedule: Literal["constant", "cosine"] = "cosine"
    precision: Literal["auto", "fp32", "fp16", "bf16"] = Field(
        "auto", description="auto: fp16+GradScaler on CUDA, bf16 autocast on CPU")
    grad_clip: float | None = Field(1.0, description="clip global grad norm (after unscale); null disables")
    device: Literal["auto", "cpu", "cuda"] = "auto"
