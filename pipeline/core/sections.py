"""Base class for config sections: strict (unknown keys are errors), typed, documented fields."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config section. Unknown keys are rejected so typos fail loudly instead of being ignored. NaN and
    infinities are refused in every float: any comparison with NaN is false, so ``min_cosine: .nan`` would
    switch a gate off without a word."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)
