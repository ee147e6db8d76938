"""PyTorch at a size the later stages run (:func:`kiln.stages.export.torch_sizes.torch_at`): a model that folds the
varied axis into the batch (a pool sized to the data's length, then ``view(-1, C)``) answers more rows than it was
given samples there, which the graph computes alike and every gate would pass; it is refused with the cause."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from kiln.core.data import from_feed
from kiln.core.errors import ModelError
from kiln.core.shapes import resize
from kiln.stages.export.torch_sizes import OwnRows, torch_at


class _PoolNet(nn.Module):
    """A point cloud [N, 3, P] pooled over P: by a pool of the data's length (``fixed``) then ``view(-1, 4)``, or
    over the whole axis."""

    def __init__(self, fixed: bool) -> None:
        super().__init__()
        self.mlp, self.head, self.fixed = nn.Conv1d(3, 4, 1), nn.Linear(4, 2), fixed
        self.pool = nn.MaxPool1d(8) if fixed else nn.AdaptiveMaxPool1d(1)

    def forward(self, points: torch.Tensor) -> torch.Tensor:
        f = self.pool(self.mlp(points))
        return self.head(f.view(-1, 4) if self.fixed else f.view(points.size(0), -1))


def _at(model: nn.Module, point: dict[str, int]) -> dict[str, np.ndarray]:
    feed = {"points": np.random.default_rng(0).random((3, 3, 8), dtype=np.float32)}
    axes = {"points": {2: "P"}}
    inputs = from_feed(resize(feed, axes, point), torch.from_numpy(feed["points"]))
    return torch_at(model.eval(), inputs, point, [feed, feed, feed], axes, {"P": [8, 32]})


def test_a_model_folding_the_points_into_the_batch_is_refused() -> None:
    with pytest.raises(ModelError) as err:
        _at(_PoolNet(fixed=True), {"P": 32})
    assert err.value.message.startswith(
        "output 'logits' has 4 rows for 1 sample at P=32 (1 at P=8): the model folds P into the batch axis"
    ), err.value.message
    assert "x.view(x.size(0), -1)" in (err.value.hint or "") and "nn.AdaptiveMaxPool1d(1)" in (err.value.hint or "")


def test_a_model_pooling_the_whole_axis_passes() -> None:
    assert _at(_PoolNet(fixed=False), {"P": 32})["logits"].shape == (3, 2)


class _Detector(nn.Module):
    """A detector's output whose length the values decide: ``rows`` rows whatever the batch; counts its forwards."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.rows, self.calls = rows, 0

    def forward(self, points: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return points.flatten(1)[:1, :2].repeat(self.rows, 1)


@pytest.mark.parametrize(("rows", "forwards"), [(1, 2 * 2), (5, 2 * 2 + 2)])
def test_the_rows_own_sizes_run_once_a_check_and_only_where_a_sample_gives_more_rows(rows: int, forwards: int) -> None:
    """Each size runs the model on its rows and on one sample; the rows' own sizes (on them, on one sample) are run
    once for the whole check, and only where one sample at a size gives more than one row."""
    feed = {"points": np.random.default_rng(0).random((3, 3, 8), dtype=np.float32)}
    axes, model, own_rows = {"points": {2: "P"}}, _Detector(rows).eval(), OwnRows()
    for point in ({"P": 16}, {"P": 32}):
        inputs = from_feed(resize(feed, axes, point), torch.from_numpy(feed["points"]))
        torch_at(model, inputs, point, [feed, feed, feed], axes, {"P": [8, 32]}, own_rows=own_rows)
    assert model.calls == forwards
