"""A model that answers the same rows differently from call to call in eval mode is refused before training, by the
checks of the model against the data, not by the export after the training it spent."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.core.errors import ModelError
from kiln.pipeline.api import run_pipeline
from kiln.pipeline.config import config_from_dict
from kiln.stages.train.stage import check_model_fits_data
from tests.conftest import tiny_config_dict
from tests.models.random_models import load, sampling, zero_noise

MODELS = "tests.models.random_models"


@pytest.mark.parametrize("how", ["randn", "counter"])
def test_a_sampling_or_counting_forward_is_refused_before_training(tmp_path: Path, how: str) -> None:
    cfg = config_from_dict(
        tiny_config_dict(
            **{"model.name": f"{MODELS}:sampling", "model.params": {"how": how}, "data.name": f"{MODELS}:load"}
        )
    )
    result, _ = run_pipeline(cfg, tmp_path, stop="export")
    assert isinstance(result.error, ModelError)
    assert "differently from call to call in eval mode" in result.error.message
    assert [(r.name, r.status) for r in result.records if r.status != "not-run"] == [("train", "failed")]


def test_the_check_leaves_a_model_whose_dropout_follows_the_mode_training() -> None:
    model = sampling("mode", 0.5)
    check_model_fits_data(model, load(), "mode:build")
    assert model.training
    check_model_fits_data(zero_noise(dropout=True), load(), "noise:build")  # nn.Dropout: no draw in eval mode


def test_noise_at_a_scale_that_starts_at_zero_is_refused_before_training(tmp_path: Path) -> None:
    """``h + self.weight * torch.randn_like(h)``, the weight at zero: two calls agree before training, and the
    export refused the graph only after the whole training."""
    model = {"model.name": f"{MODELS}:zero_noise", "model.params": {}}
    cfg = config_from_dict(tiny_config_dict(**model, **{"data.name": f"{MODELS}:load"}))
    result, _ = run_pipeline(cfg, tmp_path, stop="export")
    assert isinstance(result.error, ModelError)
    assert "draws random numbers in eval mode" in result.error.message
    assert "though its outputs did not move yet" in result.error.message
    assert [(r.name, r.status) for r in result.records if r.status != "not-run"] == [("train", "failed")]
