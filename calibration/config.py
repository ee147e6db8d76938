"""Settings of INT8 calibration."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from pipeline.sections import Section


class CalibrationConfig(Section):
    method: Literal["minmax", "entropy", "percentile"] = "minmax"
    num_batches: int = Field(8, ge=1)
    batch_size: int = Field(32, ge=1)
