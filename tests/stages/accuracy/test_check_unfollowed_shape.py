"""Labels that do not follow the class logits' positions (CTC targets beside per-frame logits) are warned of with
the logits' shape at the labels' own sizes (the scored shape), as one call on every row gives it: not at another
validated shape, nor with a time-major output's batches stacked along T."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from kiln.core.data import DatasetSplits
from kiln.stages.accuracy.check import Reference

ROWS, CLASSES = 16, 5
W = np.random.default_rng(0).standard_normal((1, CLASSES)).astype(np.float32)


def _per_frame(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per-frame logits [N, F // 2, C] of features [N, F]: every second frame's value times W."""
    return {"logits": feed["x"][:, ::2, None] @ W}


def _time_major(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The same, time-major: [F // 2, N, C]."""
    return {"logits": _per_frame(feed)["logits"].transpose(1, 0, 2).copy()}


def _warning(caplog: pytest.LogCaptureFixture, run, frames: list[int]) -> str:
    """The warning of labels [ROWS, 3] (3 tokens a sample) beside ``run``'s logits validated at each of ``frames``,
    the last the data's own (scored) size."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((ROWS, frames[-1])).astype(np.float32)
    labels = rng.integers(1, CLASSES, (ROWS, 3))
    y = torch.from_numpy(labels)
    data = DatasetSplits(torch.from_numpy(x), y, torch.from_numpy(x), y, num_classes=CLASSES)
    feeds = [({"frames": f}, {"x": x[:, :f]}) for f in frames]
    caplog.clear()
    Reference(run, feeds, [labels] * len(feeds), "logits", batch=4, data=data, named=False)
    return next(r.getMessage() for r in caplog.records if "do not follow" in r.getMessage())


def test_the_shape_is_quoted_at_the_labels_own_sizes(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(logging.getLogger("kiln"), "propagate", True)  # the CLI tests turn it off
    caplog.set_level(logging.WARNING, logger="kiln")
    said = _warning(caplog, _per_frame, [8, 16])
    assert f"'logits' [{ROWS}, 8, {CLASSES}] (they take labels [{ROWS}, 8])" in said, said


def test_a_time_major_shape_is_quoted_as_one_call_gives_it(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(logging.getLogger("kiln"), "propagate", True)
    caplog.set_level(logging.WARNING, logger="kiln")
    said = _warning(caplog, _time_major, [16])
    assert f"'logits' [8, {ROWS}, {CLASSES}]" in said and f"not the samples, {ROWS}" in said, said
