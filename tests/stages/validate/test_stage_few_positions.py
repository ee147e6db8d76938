"""Where labels are per position (a node classifier's one graph of 50 labelled nodes), the few-rows warning counts
the labelled positions top-1 agreement and accuracy are counted over: enough of them silence it."""

from __future__ import annotations

import logging

import pytest

from kiln.stages.validate.stage import warn_few_rows

LOG = logging.getLogger("kiln.test.validate.positions")


def _said(caplog: pytest.LogCaptureFixture, n: int, positions: int | None) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        warn_few_rows(LOG, n, None, positions)
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_enough_labelled_positions_are_enough_samples(caplog: pytest.LogCaptureFixture) -> None:
    assert _said(caplog, 1, 50) == []


def test_few_labelled_positions_are_said_beside_the_rows(caplog: pytest.LogCaptureFixture) -> None:
    (said,) = _said(caplog, 1, 10)
    assert "only 1 held-out row holding 10 labelled positions" in said, said
    assert "at least 32 rows or 32 labelled positions" in said, said
    (rows,) = _said(caplog, 5, None)
    assert "only 5 held-out rows (" in rows and "labelled" not in rows, rows
