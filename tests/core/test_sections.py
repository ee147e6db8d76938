"""Config sections: on/off settings take booleans and their words, however they arrive."""

from __future__ import annotations

import re
from typing import Annotated, Literal

import pytest
from pydantic import ValidationError

from kiln.core.sections import AutoOnOff, Section, bool_words


class Settings(Section):
    switch: AutoOnOff = "auto"
    mode: Annotated[Literal["auto", "off", "bias"], bool_words(None, "off")] = "auto"


@pytest.mark.parametrize(
    ("given", "want"),
    [(True, "on"), (False, "off"), ("true", "on"), ("False", "off"), ("YES", "on"), ("no", "off"), ("On", "on")],
)
def test_on_off_takes_booleans_and_their_words(given: object, want: str) -> None:
    assert Settings(switch=given).switch == want


def test_a_key_without_an_on_word_refuses_true_and_keeps_off() -> None:
    assert Settings(mode="false").mode == "off" and Settings(mode=False).mode == "off"
    with pytest.raises(ValidationError, match="'auto', 'off' or 'bias'"):
        Settings(mode="true")
    with pytest.raises(ValidationError):
        Settings(switch="maybe")


class Numbers(Section):
    count: int = 1
    ratio: float | None = None
    sizes: list[int] = [1]
    pair: tuple[float, float] = (0.0, 1.0)
    gates: dict[str, dict[str, float]] = {}
    flag: bool = False
    either: bool | int = 0
    free: dict[str, object] = {}
    switch: AutoOnOff = "auto"
    switches: list[AutoOnOff] = []


@pytest.mark.parametrize(
    ("key", "given", "said"),
    [
        ("count", True, "true is"),
        ("ratio", False, "false is"),
        ("sizes", [8, True], "true at [1] is"),
        ("pair", (0.5, True), "true at [1] is"),
        ("gates", {"fp16": {"min_cosine": True}}, "true at fp16.min_cosine is"),
    ],
)
def test_a_boolean_for_a_number_is_refused(key: str, given: object, said: str) -> None:
    """Every section, every number: pydantic alone reads true as 1 and 1.0."""
    with pytest.raises(ValidationError, match=re.escape(f"{said} a boolean where a number is due")):
        Numbers(**{key: given})
    with pytest.raises(ValidationError, match="a boolean where a number is due"):  # assignment too
        setattr(Numbers(), key, given)


def test_keys_that_take_booleans_keep_them() -> None:
    n = Numbers(flag=True, either=True, free={"on": True}, switch=True, switches=[False, "on"], count=3, ratio=1)
    assert (n.flag, n.either, n.free, n.switch, n.switches, n.count, n.ratio) == (
        True,
        True,
        {"on": True},
        "on",
        ["off", "on"],
        3,
        1.0,
    )
