"""Base class for config sections: strict (unknown keys are errors), typed, documented fields."""

from __future__ import annotations

from types import UnionType
from typing import Annotated, Any, Literal, Self, Union, get_args, get_origin

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    PlainValidator,
    ValidationInfo,
    WrapValidator,
    field_validator,
)


class Section(BaseModel):
    """A config section. Unknown keys are rejected so typos fail loudly instead of being ignored. NaN and
    infinities are refused in every float: any comparison with NaN is false, so ``min_cosine: .nan`` would
    switch a gate off without a word. A boolean is refused where a number is due, in lists and mappings too
    (pydantic would read ``epochs: true`` as 1), unless the key also takes booleans.

    Each section's validator is built when it first validates (``defer_build``), not when its module is imported:
    code that only needs a section's class (opening a packaged engine imports every backend's config section)
    does not pay for building them."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False, defer_build=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        field = cls.model_fields.get(info.field_name or "")
        if field is None or any(isinstance(m, _CONVERTERS) for m in field.metadata):
            return value  # a key with its own converter (bool_words) decides what a boolean means there
        found = bool_for_number(field.annotation, value)
        if found is not None:
            where, flag = found
            at = f" at {where}" if where else ""
            raise ValueError(f"{str(flag).lower()}{at} is a boolean where a number is due")
        return value

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


# Validators that may turn a boolean into what the key means by it (bool_words): their keys are left to them
_CONVERTERS = (BeforeValidator, PlainValidator, WrapValidator)


def _members(annotation: Any) -> list[Any]:
    """The types a value of ``annotation`` may be: a union's members, Annotated unwrapped (``Any`` where it holds a
    converter, which may take anything)."""
    if get_origin(annotation) is Annotated:
        inner, *meta = get_args(annotation)
        return [Any] if any(isinstance(m, _CONVERTERS) for m in meta) else _members(inner)
    if get_origin(annotation) in (Union, UnionType):
        return [m for a in get_args(annotation) for m in _members(a)]
    return [annotation]


def _takes_bool(member: Any) -> bool:
    return member in (bool, Any, object) or (
        get_origin(member) is Literal and any(isinstance(v, bool) for v in get_args(member))
    )


def _is_number(member: Any) -> bool:
    return isinstance(member, type) and issubclass(member, (int, float)) and not issubclass(member, bool)


def bool_for_number(annotation: Any, value: Any, where: str = "") -> tuple[str, bool] | None:
    """Where in ``value`` a boolean stands for a number ``annotation`` wants (``""``: the value itself, ``[1]``,
    ``fp16.min_cosine``) and that boolean, or None. Lists, tuples and mappings are followed into their items
    (and keys)."""
    members = _members(annotation)
    if isinstance(value, bool):
        takes = any(_takes_bool(m) for m in members)
        return (where, value) if not takes and any(_is_number(m) for m in members) else None
    found = None
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            found = found or bool_for_number(_item_type(members, i), item, f"{where}[{i}]")
    elif isinstance(value, dict):
        keys = _union(get_args(m)[0] for m in members if get_origin(m) is dict and get_args(m))
        values = _union(get_args(m)[1] for m in members if get_origin(m) is dict and get_args(m))
        for key, item in value.items():
            inner = (f"{where}.{key}" if where else key) if isinstance(key, str) else f"{where}[{key!r}]"
            found = found or bool_for_number(keys, key, inner) or bool_for_number(values, item, inner)
    return found


def _item_type(members: list[Any], i: int) -> Any:
    """The type of item ``i`` of a list or tuple of one of ``members``."""
    items = []
    for m in members:
        args = get_args(m)
        if get_origin(m) in (list, set, frozenset) and args:
            items.append(args[0])
        elif get_origin(m) is tuple and args:
            if len(args) == 2 and args[1] is Ellipsis:
                items.append(args[0])
            elif i < len(args):
                items.append(args[i])
    return _union(items)


def _union(types: Any) -> Any:
    types = tuple(types)
    return Union[types] if types else None  # noqa: UP007 - built from a tuple of types


# Random seeds reach torch.manual_seed (at most 2**64 - 1, and the train sampler adds the epoch) and numpy's
# default_rng (none below 0): a seed from 0 to 2**63 - 1 fits both, offsets included.
SEED_MAX = 2**63 - 1


def _seed_in_range(value: int) -> int:
    if not 0 <= value <= SEED_MAX:
        raise ValueError(f"a seed is a whole number from 0 to {SEED_MAX} (2**63 - 1), as torch and numpy take it")
    return value


Seed = Annotated[int, AfterValidator(_seed_in_range)]
