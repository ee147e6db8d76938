"""Config sections: on/off settings take booleans and their words, however they arrive."""

from __future__ import annotations

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
