"""A binary classifier's one logit that decides alike at every held-out row (a head that learnt only the prior):
top-1 agreement of its decision then asks an engine only to keep every value on that side of the threshold, which
an engine answering a constant does; the reference warns of it once."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from kiln.stages.accuracy.check import Reference

ROWS = 32


def _warned(caplog: pytest.LogCaptureFixture, logit: np.ndarray, labels: np.ndarray) -> list[str]:
    """The one-side warnings of a reference whose one logit ``[N, 1]`` is ``logit``, beside 0/1 ``labels``."""
    x = np.arange(ROWS, dtype=np.float32)[:, None]  # each row its own index: rows run alone answer alike
    caplog.clear()
    Reference(lambda feed: {"logit": logit[feed["x"][:, 0].astype(int)]}, [({}, {"x": x})], [labels], "logit", 4)
    return [r.getMessage() for r in caplog.records if "the reference decides" in r.getMessage()]


def test_a_one_logit_reference_that_decides_alike_everywhere_is_warned_of(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(logging.getLogger("kiln"), "propagate", True)  # the CLI tests turn it off
    caplog.set_level(logging.WARNING, logger="kiln")
    rng = np.random.default_rng(0)
    labels = (rng.random(ROWS) < 0.125).astype(np.int64)  # mostly negative: the prior scores 0.875
    prior = rng.uniform(-0.165, -0.128, (ROWS, 1)).astype(np.float32)  # every row decided negative
    said = _warned(caplog, prior, labels)
    assert len(said) == 1 and said[0].startswith("the reference decides negative at all 32 rows of output 'logit'")
    assert "validate.metric" in said[0] and "ROC AUC" in said[0]
    mixed = rng.standard_normal((ROWS, 1)).astype(np.float32)
    assert (mixed > 0).any() and (mixed <= 0).any()
    assert not _warned(caplog, mixed, labels)
