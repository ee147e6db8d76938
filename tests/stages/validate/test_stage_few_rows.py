"""The pipeline's validate stage warns where the engines are compared on fewer than 32 held-out rows, naming
validate.max_samples where it caps them, as ``kiln validate`` warns of short ``--inputs``."""

from __future__ import annotations

import logging

import pytest

from kiln.stages.validate.stage import warn_few_rows

LOG = logging.getLogger("kiln.test.validate")


def _said(caplog: pytest.LogCaptureFixture, n: int, max_samples: int | None) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        warn_few_rows(LOG, n, max_samples)
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_few_held_out_rows_are_warned_of_with_what_caps_them(caplog: pytest.LogCaptureFixture) -> None:
    (capped,) = _said(caplog, 5, 5)
    assert "only 5 held-out rows" in capped and "validate.max_samples 5" in capped and "at least 32" in capped
    (split,) = _said(caplog, 10, None)
    assert "only 10 held-out rows" in split and "held-out split" in split and "max_samples" not in split
    assert _said(caplog, 32, None) == [] and _said(caplog, 64, 40) == []
