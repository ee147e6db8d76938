"""Images the model's forward fails on before training because of how the data gives them, uint8 pixels or channels
last (NHWC), get the conversion as the fix rather than the generic one."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kiln.core.data import DatasetSplits
from kiln.core.errors import ModelError
from kiln.stages.train.stage import check_model_fits_data


class Conv(nn.Module):
    """A classifier of RGB images given as NCHW ``pixel_values``, as Hugging Face's vision models take them."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.net(pixel_values)


def _conv() -> nn.Module:
    return Conv()


def _data(x: torch.Tensor) -> DatasetSplits:
    y = torch.arange(len(x)) % 2
    return DatasetSplits({"pixel_values": x}, y, {"pixel_values": x}, y, num_classes=2, name="imgs:load")


def test_uint8_pixels_are_said_to_be_converted_and_scaled() -> None:
    pixels = torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8)
    with pytest.raises(ModelError) as e:
        check_model_fits_data(_conv(), _data(pixels), "conv:build")
    assert e.value.hint.startswith(
        "give input 'pixel_values' (uint8) as float32, the dtype of the model's weights (pixel_values.float() / 255 "
        "in the data function 'imgs:load'"
    )


def test_channels_last_images_are_said_to_be_permuted() -> None:
    with pytest.raises(ModelError) as e:
        check_model_fits_data(_conv(), _data(torch.rand(4, 8, 8, 3)), "conv:build")
    assert e.value.hint == (
        "give input 'pixel_values' in the layout the model takes (it looks like NHWC, and the model takes NCHW: "
        "x.transpose(0, 3, 1, 2); a torch tensor: x.permute(0, 3, 1, 2)) in the data function 'imgs:load'"
    )


def test_images_of_the_wrong_channel_count_keep_the_generic_fix() -> None:
    with pytest.raises(ModelError) as e:
        check_model_fits_data(_conv(), _data(torch.rand(4, 8, 8, 1)), "conv:build")
    assert e.value.hint.startswith("make data.name/data.params produce what the model expects")
