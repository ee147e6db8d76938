"""Base class for config sections: strict (unknown keys are errors), typed, documented fields."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config section. Unknown keys are rejected so typos fail loudly instead of being ignored."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
