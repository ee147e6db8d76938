"""`kiln serve` says which engines Triton serves unbatched (``max_batch_size: 0``) and why: a model with a per-sample
scalar input (``lang_id [batch]``) otherwise loses dynamic batching without a word."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from kiln.serve.server import say_unbatched
from kiln.stages.package.triton import served_max_batch
from tests.serve.served import served


def _served(inputs: dict[str, list[int | str]], name: str = "mt_fp32") -> SimpleNamespace:
    return served({k: (v, "int64") for k, v in inputs.items()}, [1, 8], name)


def test_an_engine_with_a_batch_axis_alone_is_said_served_unbatched(caplog: pytest.LogCaptureFixture) -> None:
    scalar = _served({"tokens": ["batch", "seq"], "lang_id": ["batch"]})
    assert served_max_batch(scalar.meta, 8) == 0  # what the server configures
    with caplog.at_level(logging.WARNING, logger="kiln.serve.server"):
        say_unbatched([scalar, _served({"tokens": ["batch", "seq"]}, "plain_fp32")])
    (line,) = caplog.messages
    assert line.startswith("mt_fp32: served unbatched"), line
    assert "input 'lang_id' is [batch]" in line and "exported as [batch, 1]" in line


def test_other_causes_are_said_as_the_package_check_says_them(caplog: pytest.LogCaptureFixture) -> None:
    fixed = _served({"tokens": [1, "seq"]}, "fixed_fp32")  # exported with a fixed batch of one
    with caplog.at_level(logging.WARNING, logger="kiln.serve.server"):
        say_unbatched([fixed])
    assert "fixed_fp32: served unbatched" in caplog.text and "without a dynamic first axis" in caplog.text
    assert "[batch, 1]" not in caplog.text
