"""Float targets that are values per position of an output (an upscaler's images ``[N, 3, 2H, 2W]`` of inputs
``[N, 3, H, W]``) fit only the data's own sizes, as labels per pixel do: the metric is measured there (a shape of
their own where it lies within the validated ranges), or nowhere, said with the fix, never on outputs of another
size than the targets."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
import torch

from kiln.core.data import DatasetSplits, as_feed
from kiln.core.labels import follows_output
from kiln.stages.accuracy.check import held_out, held_out_reference
from kiln.stages.accuracy.config import CheckConfig

AXES = {"input": {2: "h", 3: "w"}}


def _upscale(x: np.ndarray) -> np.ndarray:
    return np.repeat(np.repeat(x, 2, axis=2), 2, axis=3)


def _run(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A x2 upscaler: each pixel repeated 2x2."""
    return {"logits": _upscale(feed["input"]) * 0.9}


def _data() -> DatasetSplits:
    """Images [3, 8, 8] and their x2 upscales [3, 16, 16] as float targets."""
    x = torch.rand(24, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    y = torch.from_numpy(_upscale(x.numpy()))
    return DatasetSplits(x[:8], y[:8], x[8:], y[8:])


def psnr(outputs: dict[str, np.ndarray], labels: np.ndarray) -> float:
    """A user's metric: it broadcasts the output against the targets, failing on another size."""
    return float(-10 * np.log10(np.mean((outputs["logits"] - labels) ** 2) + 1e-12))


def _reference(shapes: dict[str, list[int]], metric: bool = True) -> Any:
    data = _data()
    feeds = held_out(data, lambda v: as_feed(v, ["input"]), AXES, shapes, None)
    cfg = CheckConfig(metric=f"{__name__}:psnr" if metric else None)
    return held_out_reference(_run, feeds, data, None, cfg, [1, 4], AXES)


def test_upscaled_targets_outside_the_validated_sizes_leave_the_metric_unmeasured(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Data of 8x8 beside ``signature.shapes: {h: [12, 24], w: [12, 32]}``: the targets fit no validated size, so
    the metric is not measured, said with the fix; before, the metric got outputs [16, 3, 48, 64] beside targets
    [16, 3, 16, 16] and the user's metric failed, its fix blaming the metric."""
    with caplog.at_level(logging.WARNING, logger="kiln"):
        ref = _reference({"h": [12, 24], "w": [12, 32]})
    assert ref.score is None and ref.metric_value is None and ref.followed == "logits"
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "values per position of output 'logits'" in said and "add the data's sizes to signature.shapes" in said
    assert "task accuracy" not in said


def test_upscaled_targets_are_scored_at_the_datas_own_sizes_within_the_validated_range() -> None:
    """Data of 8x8 within ``{h: [6, 12], w: [6, 12]}``: the data's own sizes are validated as a shape of their
    own, where the metric reads outputs of the targets' size."""
    ref = _reference({"h": [6, 12], "w": [6, 12]})
    assert ref.feeds[ref.score][0] == {"h": 8, "w": 8}
    own = _run({"input": _data().val_x.numpy()})
    assert ref.metric_value == pytest.approx(psnr(own, _data().val_y.numpy()))


def test_upscaled_targets_without_a_metric_get_the_default_at_their_own_sizes() -> None:
    """No validate.metric: mse, the default for float targets, scores the prediction at the data's own sizes."""
    ref = _reference({"h": [6, 12], "w": [6, 12]}, metric=False)
    assert ref.metric is not None and ref.metric.name == "mse" and ref.metric_value is not None


def test_follows_output_needs_an_output_whose_shape_follows_the_inputs() -> None:
    """Targets the shape of an output that stays one shape at every size (a per-row regression) follow none."""
    y = np.zeros((4, 3, 16, 16), np.float32)
    own = {"logits": np.zeros((1, 3, 16, 16), np.float32)}
    assert follows_output(y, own, [{"logits": np.zeros((1, 3, 24, 24), np.float32)}]) == "logits"
    assert follows_output(y, own, [own]) is None
    assert follows_output(y.astype(np.int64), own, [{"logits": np.zeros((1, 3, 24, 24))}]) is None


def _mean_run(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A regression of one value per image: its mean."""
    return {"logits": feed["input"].mean(axis=(1, 2, 3))[:, None]}


def test_targets_per_row_at_lengthened_sizes_are_said_as_a_metric_on_repeated_inputs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Float targets per row, the data's 8x8 below every validated size: the metric is measured at the largest, on
    inputs lengthened by repeating their values, said so: no task accuracy (a regression has none), nothing cut."""
    data = _data()
    data = DatasetSplits(
        data.train_x, data.train_x.mean((1, 2, 3))[:, None], data.val_x, data.val_x.mean((1, 2, 3))[:, None]
    )
    feeds = held_out(data, lambda v: as_feed(v, ["input"]), AXES, {"h": [12, 24], "w": [12, 32]}, None)
    with caplog.at_level(logging.WARNING, logger="kiln"):
        held_out_reference(_mean_run, feeds, data, None, CheckConfig(metric="mse"), [1, 4], AXES)
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "the metric measured at h=24, w=32" in said and "lengthened along h, w by repeating" in said
    assert "task accuracy" not in said and "cut" not in said


def test_targets_per_row_at_cut_sizes_are_said_cut(caplog: pytest.LogCaptureFixture) -> None:
    """The data's 8x8 above every validated size: the inputs there are cut, said with the end they keep."""
    data = _data()
    data = DatasetSplits(
        data.train_x, data.train_x.mean((1, 2, 3))[:, None], data.val_x, data.val_x.mean((1, 2, 3))[:, None]
    )
    feeds = held_out(data, lambda v: as_feed(v, ["input"]), AXES, {"h": [4, 6], "w": [4, 6]}, None)
    with caplog.at_level(logging.WARNING, logger="kiln"):
        held_out_reference(_mean_run, feeds, data, None, CheckConfig(metric="mse"), [1, 4], AXES)
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "cut along h, w (keeping the first positions" in said and "repeating" not in said
