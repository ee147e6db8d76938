"""Settings of the precision stage (FP16 mixed precision, INT8 via calibration)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from pipeline.sections import Section

Precision = Literal["fp32", "fp16", "int8"]


class PrecisionConfig(Section):
    variants: list[Precision] = Field(default_factory=lambda: ["fp32"], description="graph precisions to build")
