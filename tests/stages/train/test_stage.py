"""The train stage's messages about the data: labels left to validation with training off, NHWC uint8 images."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn

from kiln.core.data import DatasetSplits
from kiln.core.errors import ModelError
from kiln.pipeline.config import config_from_dict
from kiln.pipeline.runner import Runner
from kiln.pipeline.stage_list import STAGES
from kiln.stages.train.stage import check_model_fits_data
from tests.conftest import tiny_config_dict


def test_box_labels_with_training_off_are_no_warning_of_a_missing_metric(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It warned "val accuracy not measured ... mean squared error needs the same shape" of labels that only
    validate.metric (which the train stage does not see) reads."""
    boxes = "tests.stages.train.test_train_stage"  # its detector head and box labels
    over = {
        "train.enabled": False,
        "model.name": f"{boxes}:BoxHead",
        "model.params": {},
        "data.name": f"{boxes}:box_data",
    }
    monkeypatch.setattr(logging.getLogger("kiln"), "propagate", True)  # the CLI tests turn it off
    caplog.set_level(logging.INFO, logger="kiln")
    result = Runner(config_from_dict(tiny_config_dict(**over)), tmp_path / "wd", STAGES).run(stop="train")
    assert result.ok, result.error
    assert result.records[0].summary.val_accuracy is None
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [m for m in warned if "accuracy" in m or "mean squared error" in m], warned
    told = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and "val accuracy" in r.getMessage()]
    assert any("float labels [8, 1, 5] are not class ids" in m and "not measured" not in m for m in told), told


class Conv(nn.Module):
    """A classifier of RGB images given as NCHW, whose forward checks the channels first (as Hugging Face's do)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        if pixel_values.shape[1] != 3:
            raise ValueError("Make sure that the channel dimension of the pixel values match the configuration.")
        return self.net(pixel_values)


def test_nhwc_uint8_images_are_said_to_be_permuted_and_converted() -> None:
    """uint8 NHWC images got only the model's own error and the generic fix: the layout check read floats alone."""
    pixels = torch.randint(0, 256, (4, 8, 8, 3), dtype=torch.uint8)
    y = torch.arange(4) % 2
    data = DatasetSplits({"pixel_values": pixels}, y, {"pixel_values": pixels}, y, num_classes=2, name="imgs:load")
    with pytest.raises(ModelError) as e:
        check_model_fits_data(Conv(), data, "conv:build")
    assert e.value.hint.startswith(
        "give input 'pixel_values' in the layout the model takes (it looks like NHWC, and the model takes NCHW: "
        "x.transpose(0, 3, 1, 2); a torch tensor: x.permute(0, 3, 1, 2)); and give input 'pixel_values' (uint8) as "
        "float32"
    ), e.value.hint
    assert "pixel_values.float() / 255 in the data function 'imgs:load'" in e.value.hint


class Pcm(nn.Module):
    """An audio classifier on float samples: a 1-D convolution over [N, samples]."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(1, 2, 5)

    def forward(self, input_values: torch.Tensor) -> torch.Tensor:
        return self.conv(input_values[:, None]).mean(-1)


def test_int16_pcm_samples_are_said_to_be_converted_and_scaled() -> None:
    """int16 waveforms got torch's 'expected scalar type Short but found Float' and the generic fix."""
    samples = torch.randint(-32768, 32767, (4, 64), dtype=torch.int16)
    y = torch.arange(4) % 2
    data = DatasetSplits({"input_values": samples}, y, {"input_values": samples}, y, num_classes=2, name="pcm:load")
    with pytest.raises(ModelError) as e:
        check_model_fits_data(Pcm(), data, "pcm:build")
    assert e.value.hint.startswith("give input 'input_values' (int16) as float32"), e.value.hint
    assert "input_values.float() / 32768 in the data function 'pcm:load'" in e.value.hint
    assert "to -1..1" in e.value.hint
