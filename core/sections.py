"""Base class for config sections: strict (unknown keys are errors), typed, documented fields."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, BeforeValidator, ConfigDict


class Section(BaseModel):
    """A config section. Unknown keys are rejected so typos fail loudly instead of being ignored. NaN and
    infinities are refused in every float: any comparison with NaN is false, so ``min_cosine: .nan`` would
    switch a gate off without a word."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    def only(self, *keys: str) -> Self:
        """A copy exposing only ``keys``; reading another of its fields is an AttributeError. A stage that reads
        part of a shared section gets this view, so its cache key covers everything it can read."""
        view = self.model_copy()
        for name in set(type(self).model_fields) - set(keys):
            view.__dict__.pop(name, None)
        return view

    @classmethod
    def subsections(cls) -> dict[str, type[Section]]:
        """Sections held beyond the declared fields, by key (a registry's: ``build.<backend>``)."""
        return {}


_TRUE, _FALSE = {"true", "yes", "on"}, {"false", "no", "off"}


def bool_words(true: str | None, false: str) -> BeforeValidator:
    """For a key that takes words: a boolean, as YAML reads ``true`` / ``on`` / ``yes`` (and JSON and TOML
    ``true``), or one of those words as text (``--set key=false``, any case), becomes the word the key means by
    it (``true`` None: a true value has no meaning there, and stays an error)."""

    def words(value: Any) -> Any:
        word = value.strip().lower() if isinstance(value, str) else value
        if (value is True or word in _TRUE) and true is not None:
            return true
        if value is False or word in _FALSE:
            return false
        return word if isinstance(value, str) and word in (true, false) else value

    return BeforeValidator(words)


# A setting that is on, off, or decided by Kiln: `key: on` in a YAML file means "on", not a type error
AutoOnOff = Annotated[Literal["auto", "on", "off"], bool_words("on", "off")]
