"""Labels beside class logits whose rows are not the samples (time-major [T, N, C]): no task accuracy, no error."""

import logging

import numpy as np
import pytest
import torch

from kiln.core.data import DatasetSplits
from kiln.stages.accuracy.check import Reference

W = np.random.default_rng(0).standard_normal((4, 6 * 5)).astype(np.float32)


def _time_major(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A CRNN's per-frame logits, time-major: [T=6, N, C=5]."""
    x = feed["x"]
    return {"logits": (x @ W).reshape(len(x), 6, 5).transpose(1, 0, 2).copy()}


def test_labels_beside_time_major_logits_are_warned_of_not_an_error(caplog: pytest.LogCaptureFixture) -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((16, 4)).astype(np.float32)
    labels = rng.integers(1, 5, (16, 3))  # CTC targets: 3 tokens per sample
    y = torch.from_numpy(labels)
    data = DatasetSplits(torch.from_numpy(x), y, torch.from_numpy(x), y, num_classes=5)
    with caplog.at_level(logging.WARNING, logger="kiln.validate"):
        ref = Reference(_time_major, [({}, {"x": x})], [labels], "logits", batch=4, data=data, named=False)
    assert ref.accuracy is None and ref.labels is None
    assert any("no task accuracy" in r.getMessage() for r in caplog.records)
