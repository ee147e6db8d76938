"""The fix an engine gives for a feed that is no dict (a list of arrays, one bare array): the dict it takes, each
input named with an array, written as Python."""

from __future__ import annotations

import ast

import pytest

from kiln.core.errors import InputError
from kiln.stages.engines.backend import check_feed
from tests.stages.engines.test_backend import GOOD, META


@pytest.mark.parametrize("feed", [list(GOOD.values()), GOOD["input_ids"]], ids=["list", "array"])
def test_a_feed_that_is_no_dict_is_told_the_dict_with_each_input_named(feed: object) -> None:
    with pytest.raises(InputError) as e:
        check_feed(META, feed)  # type: ignore[arg-type]
    assert e.value.hint == "pass {'input_ids': array, 'pixels': array}"
    shown = ast.parse(e.value.hint.removeprefix("pass "), mode="eval").body
    assert isinstance(shown, ast.Dict) and [k.value for k in shown.keys] == ["input_ids", "pixels"]  # type: ignore[union-attr]
