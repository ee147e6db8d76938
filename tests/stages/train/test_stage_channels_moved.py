"""Video clips given as [N, T, C, H, W] to a model of [N, C, T, H, W]: the error before training gives the permute
that puts the channels second, as the calibration, validation and serving paths do."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kiln.core.data import DatasetSplits
from kiln.core.errors import ModelError
from kiln.stages.train.stage import check_model_fits_data


def _clips(x: torch.Tensor) -> DatasetSplits:
    y = torch.tensor([0, 1, 0, 1])
    return DatasetSplits(x, y, x, y, num_classes=2, name="vid:load")


def _model() -> nn.Module:
    return nn.Sequential(nn.Conv3d(3, 4, 3, padding=1), nn.AdaptiveAvgPool3d(1), nn.Flatten(), nn.Linear(4, 2))


def test_channels_on_another_axis_get_the_permute_that_moves_them() -> None:
    with pytest.raises(ModelError) as e:
        check_model_fits_data(_model(), _clips(torch.randn(4, 5, 3, 6, 6)), "vid:build")
    assert "x.transpose(0, 2, 1, 3, 4)" in (e.value.hint or "") and "'vid:load'" in (e.value.hint or ""), e.value.hint


def test_channels_on_no_axis_keep_the_general_fix() -> None:
    with pytest.raises(ModelError) as e:
        check_model_fits_data(_model(), _clips(torch.randn(4, 5, 2, 6, 6)), "vid:build")
    assert "transpose" not in (e.value.hint or "") and "data.name/data.params" in (e.value.hint or "")
