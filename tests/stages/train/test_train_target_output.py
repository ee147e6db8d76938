"""Several outputs, none named by signature.logits_output nor ``logits``: the built-in loss reads the one output shaped
like the targets (a forecaster's ``prediction_outputs`` beside its ``loc`` and ``scale``), chosen on the probe before
training and said once; where none or several are, the probe asks which, before any training."""

from __future__ import annotations

import logging
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from torch import nn

from kiln.core.data import DatasetSplits
from kiln.core.errors import ConfigError
from kiln.pipeline.config import config_from_dict
from kiln.pipeline.runner import load_dataset, settings_for
from kiln.pipeline.stage_list import stage_named
from kiln.stages.train import stage as train_stage
from kiln.stages.train.stage import check_model_fits_data, train_to
from kiln.stages.train.task import task_for
from tests.conftest import tiny_config_dict

CTX, HOR, C = 8, 4, 3
ME = "tests.stages.train.test_train_target_output"


class Forecaster(nn.Module):
    """PatchTST's outputs in small: an ordered mapping (a ModelOutput is one) of the forecast ``[N, HOR, C]`` and the
    series' ``loc`` and ``scale`` ``[N, 1, C]``; ``twin`` adds a second output of the forecast's shape."""

    def __init__(self, twin: bool = False) -> None:
        super().__init__()
        self.head = nn.Linear(CTX, HOR)
        self.twin = twin

    def forward(self, past_values: torch.Tensor) -> OrderedDict[str, torch.Tensor]:
        loc = past_values.mean(1, keepdim=True)
        scale = past_values.std(1, keepdim=True) + 1e-5
        pred = self.head(((past_values - loc) / scale).transpose(1, 2)).transpose(1, 2) * scale + loc
        out = OrderedDict(prediction_outputs=pred, loc=loc, scale=scale)
        if self.twin:
            out["smoothed"] = pred.detach() * 0.5
        return out


class Classifier(nn.Module):
    """Class scores ``[N, 5]`` beside an embedding ``[N, 8]``, neither named ``logits``."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 8)
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.body(x)
        return {"embedding": h, "class_scores": self.head(h)}


def build(twin: bool = False) -> nn.Module:
    return Forecaster(twin)


def load() -> DatasetSplits:
    g = torch.Generator().manual_seed(0)
    s = torch.randn(48, CTX + HOR, C, generator=g)
    x, y = s[:, :CTX], s[:, CTX:]
    return DatasetSplits({"past_values": x[:32]}, y[:32], {"past_values": x[32:]}, y[32:])


def _checked(model: nn.Module, data: DatasetSplits) -> str | int | None:
    task = check_model_fits_data(model, data, "fc:build", task_for(data, None, None))
    assert task is not None
    return task.logits_output


def test_the_one_output_shaped_like_the_targets_is_trained_and_said_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kiln.train"):
        assert _checked(Forecaster(), load()) == "prediction_outputs"
    said = [r.getMessage() for r in caplog.records if "against the targets" in r.getMessage()]
    assert said == [
        "training 'prediction_outputs' against the targets: the only output shaped like them [N, 4, 3]; set "
        "signature.logits_output to choose another"
    ]


def test_two_outputs_shaped_like_the_targets_are_asked_about_on_the_probe() -> None:
    with pytest.raises(ConfigError, match="which is the target output of the loss"):
        _checked(Forecaster(twin=True), load())


def test_a_named_output_is_kept() -> None:
    data = load()
    task = check_model_fits_data(Forecaster(twin=True), data, "fc:build", task_for(data, None, "smoothed"), "smoothed")
    assert task is not None and task.logits_output == "smoothed"


def test_class_scores_beside_an_embedding_are_the_class_logits() -> None:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 6, generator=g), torch.randint(0, 5, (16,), generator=g)
    data = DatasetSplits(x[:12], y[:12], x[12:], y[12:], num_classes=5)
    assert _checked(Classifier(), data) == "class_scores"
    wrong_width = DatasetSplits(x[:12], y[:12], x[12:], y[12:], num_classes=8)  # the embedding's: features
    with pytest.raises(ConfigError, match="which is the class-logit output"):
        _checked(Classifier(), wrong_width)


def test_the_forecaster_trains_without_signature_logits_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = config_from_dict(
        tiny_config_dict(**{"model.name": f"{ME}:build", "model.params": {}, "data.name": f"{ME}:load"})
        | {"train": {"epochs": 1, "batch_size": 16, "compile": "off"}}
    )
    (tmp_path / "out").mkdir()
    summary = train_to(tmp_path / "out", settings_for(stage_named("train"), cfg), load_dataset(cfg), tmp_path / "ck")
    assert summary.val_loss is not None and summary.val_accuracy is None
    trained = []
    monkeypatch.setattr(train_stage, "train", lambda *a, **k: trained.append(a))
    cfg = config_from_dict(
        tiny_config_dict(**{"model.name": f"{ME}:build", "model.params": {"twin": True}, "data.name": f"{ME}:load"})
        | {"train": {"epochs": 1, "batch_size": 16, "compile": "off"}}
    )
    with pytest.raises(ConfigError, match="which is the target output of the loss"):
        train_to(tmp_path / "out", settings_for(stage_named("train"), cfg), load_dataset(cfg), tmp_path / "ck2")
    assert not trained  # asked on the probe, before training starts
