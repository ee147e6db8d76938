"""The loss plot: fixed margins (no text measured to fit them) that still hold every label."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.stages.train.metrics import EpochMetrics, plot_loss
from tests.stages.precision.test_node_errors_plot import _drawn, assert_text_inside


@pytest.mark.parametrize("scale", [2.3, 0.0012, 3e-6, 4.0e4])
def test_loss_plot_fits_without_fitting_margins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, scale: float) -> None:
    figures = _drawn(monkeypatch)
    history = [EpochMetrics(e, scale / e, 800.0, 10, 0.01, val_loss=scale * 1.1 / e) for e in range(1, 9)]
    plot_loss(history, tmp_path / "loss.png", "Training loss: a model with a long descriptive name")
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (fig,) = figures
    assert_text_inside(fig)
