"""PyTorch at a size ``signature.shapes`` lists (:func:`kiln.stages.export.torch_sizes.torch_at`): where the model
runs at the data's size alone on that axis (a cloud laid out [N, P, 3] with axis 2, its xyz, named as the points),
the fix names the axis the model fixes, not the listed size."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from kiln.core.data import from_feed
from kiln.core.errors import ModelError
from kiln.core.shapes import resize
from kiln.stages.export.torch_sizes import torch_at


class _PointsLast(nn.Module):
    """Points [N, P, 3]: a shared layer over each point's xyz, then a max over the points."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Linear(3, 4)

    def forward(self, points: torch.Tensor) -> torch.Tensor:
        return self.mlp(points).amax(dim=1)


def test_a_listed_size_on_an_axis_the_model_fixes_names_the_fixed_axis() -> None:
    feed = {"points": np.random.default_rng(0).random((2, 16, 3), dtype=np.float32)}
    axes, point = {"points": {2: "P"}}, {"P": 16}
    inputs = from_feed(resize(feed, axes, point), torch.from_numpy(feed["points"]))
    with pytest.raises(ModelError) as err:
        torch_at(_PointsLast().eval(), inputs, point, [feed, feed, feed], axes, {"P": [16, 64]})
    assert "the model fixes axis 2 of 'points' (P): it runs at the data's 3 alone there" in err.value.message, (
        err.value.message
    )
    assert (err.value.hint or "").startswith(
        "remove the axis from signature.dynamic_axes (axis 2 of 'points': the model takes only 3 there); if another "
        "axis varies, name that one instead (samples in the data: 'points' [16, 3])"
    ), err.value.hint
