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
from tests.models.random_models import load, sampling

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
