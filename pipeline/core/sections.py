"""Base class for config sections: strict (unknown keys are errors), typed, documented fields."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict


class Section(BaseModel):
    """A config section. Unknown keys are rejected so typos fail loudly instead of being ignored. NaN and
    infinities are refused in every float: any comparison with NaN is false, so ``min_cosine: .nan`` would
    switch a gate off without a word."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


def _switch(value: Any) -> Any:
    """YAML 1.1 (PyYAML) reads a bare ``on`` / ``off`` as true / false: give such a key back the word it was."""
    return ("on" if value else "off") if isinstance(value, bool) else value


# A setting that is on, off, or decided by Kiln: `key: on` in a YAML file means "on", not a type error
AutoOnOff = Annotated[Literal["auto", "on", "off"], BeforeValidator(_switch)]
