"""A PyTorch baseline's peak memory (load and largest batch, as the engines') is at least the bytes of its weights:
the report showed a baseline smaller than its own weights where the sampled growth fell short of them."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from torch import nn

from kiln.stages.validate import baselines


class _ShortMeter:
    """A meter whose sampled growth fell short of the weights (the process freed other memory meanwhile)."""

    method = "fake"

    def __init__(self, device: str) -> None:
        self.peak_mb: float | None = 0.01

    def __enter__(self) -> _ShortMeter:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


def test_the_baseline_figure_is_at_least_its_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(baselines, "PeakMemory", _ShortMeter)
    monkeypatch.setattr(baselines, "wait_a_sample", lambda: None)
    model = nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 4))  # 0.02 MB of float32 weights
    batches = {1: np.zeros((1, 16), np.float32)}
    base, _ = baselines.prepare_baseline(model, "eager", "cpu", "fp32", batches, warmup=1, samples=1)
    weights_mb = sum(p.numel() * 4 for p in model.parameters()) / 2**20
    assert base.memory is not None and base.memory.peak_mb is not None
    assert base.memory.peak_mb >= float(f"{weights_mb:.3g}")


def test_a_baseline_not_measured_stays_not_measured() -> None:
    assert baselines._with_weights(None, 10**6) is None
    assert baselines._with_weights(5.0, 10**6) == 5.0
