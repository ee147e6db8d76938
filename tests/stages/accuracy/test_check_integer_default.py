"""A default class-logit output of integers (an argmax's class ids) holds no class scores: it is held to its share
of equal values, and the warning that it is compared by cosine and could be named as class logits is not given."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from kiln.stages.accuracy.check import direct_top1


@pytest.mark.parametrize("values", [np.arange(8, dtype=np.int64) % 3, np.arange(8) % 2 == 0])
def test_an_integer_or_boolean_default_output_is_not_warned_of_as_float(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, values: np.ndarray
) -> None:
    monkeypatch.setattr(logging.getLogger("kiln"), "propagate", True)  # the CLI tests turn it off
    caplog.set_level(logging.INFO, logger="kiln")
    assert direct_top1(["pred"], None, {"pred": values}) is None
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert "held to the share of its values equal to the reference's" in caplog.text


def test_a_float_default_output_is_still_warned_of(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(logging.getLogger("kiln"), "propagate", True)
    caplog.set_level(logging.INFO, logger="kiln")
    assert direct_top1(["pred"], None, {"pred": np.zeros((8, 3), np.float32)}) is None
    assert any("compared by cosine" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
