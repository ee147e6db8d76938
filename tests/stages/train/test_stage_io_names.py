"""Outputs named like inputs (a diffusers UNet's ``forward(sample=...)`` returning ``{"sample": eps}``) are refused
by the checks before training, with the export's error, rather than after training and a whole export."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kiln.core.data import DatasetSplits
from kiln.core.errors import ModelError
from kiln.stages.train.stage import check_model_fits_data


class SampleOut(nn.Module):
    """Returns ``{"sample": ...}`` from ``forward(sample, timestep)``, as diffusers' UNet2DConditionOutput does."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, sample: torch.Tensor, timestep: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"sample": self.lin(sample) + timestep[:, None]}


class NoisePred(SampleOut):
    """The same model under a wrapper whose output is named ``noise_pred``."""

    def forward(self, sample: torch.Tensor, timestep: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"noise_pred": super().forward(sample, timestep)["sample"]}


def _data(as_dict: bool) -> DatasetSplits:
    x = {"sample": torch.randn(6, 4), "timestep": torch.rand(6)}
    given = x if as_dict else (x["sample"], x["timestep"])
    return DatasetSplits(given, torch.randn(6, 4), given, torch.randn(6, 4), name="noise:load")


@pytest.mark.parametrize("as_dict", [True, False])
def test_an_output_named_like_an_input_is_refused_before_training(as_dict: bool) -> None:
    """Inputs named by the dict's keys or by the forward's parameters, as the export names them."""
    with pytest.raises(ModelError) as e:
        check_model_fits_data(SampleOut(), _data(as_dict), "unet:build")
    assert e.value.message == "the model's outputs ['sample'] are named like its inputs; an ONNX graph cannot have both"
    assert "{'noise_pred': self.model(...)['sample']}" in e.value.hint


def test_outputs_named_otherwise_pass() -> None:
    check_model_fits_data(NoisePred(), _data(True), "unet:build")
