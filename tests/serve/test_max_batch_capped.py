"""`kiln serve --max-batch` above what an engine was validated for is said, not silently overridden."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from kiln.serve.server import say_capped
from tests.serve.served import served


def _served(validated: list[int]) -> SimpleNamespace:
    return served({"input": (["batch", 8], "float32")}, validated)


def test_a_max_batch_above_the_validated_batches_is_said_as_capped(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kiln.serve.server"):
        say_capped([_served([1, 8])], 64)
    assert "e_fp32: --max-batch 64 capped to 8, the largest batch it was validated at" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kiln.serve.server"):
        say_capped([_served([1, 8])], 8)  # what was validated: nothing to say
        say_capped([_served([1, 8])], 0)  # no batching asked for
    assert not caplog.text
