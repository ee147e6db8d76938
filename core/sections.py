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


def bool_words(true: str | None, false: str) -> BeforeValidator:
    """For a key that takes words: YAML 1.1 (PyYAML) reads a bare ``on`` / ``off`` / ``yes`` / ``no`` as a boolean,
    which becomes the word the key means by it (``true`` None: a boolean true has no meaning there, an error)."""

    def words(value: Any) -> Any:
        if value is True and true is not None:
            return true
        return false if value is False else value

    return BeforeValidator(words)


# A setting that is on, off, or decided by Kiln: `key: on` in a YAML file means "on", not a type error
AutoOnOff = Annotated[Literal["auto", "on", "off"], bool_words("on", "off")]
