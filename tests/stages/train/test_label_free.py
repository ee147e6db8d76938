"""Training without labels: a dataset whose train_y is None trains where train.loss is given (an in-batch
contrastive loss reads the outputs alone: it is called as loss(outputs, None)); without train.loss it is one error
naming that way too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from kiln.core.data import DatasetSplits
from kiln.core.errors import ConfigError
from kiln.pipeline.config import config_from_dict
from kiln.pipeline.runner import load_dataset, settings_for
from kiln.pipeline.stage_list import stage_named
from kiln.stages.train.stage import train_to
from tests.conftest import tiny_config_dict

HERE = "tests.stages.train.test_label_free"
SEEN: list[object] = []


class TwoTowers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.d = nn.Linear(8, 16), nn.Linear(8, 16)

    def forward(self, query: torch.Tensor, doc: torch.Tensor) -> dict[str, torch.Tensor]:
        q, d = nn.functional.normalize(self.q(query), dim=-1), nn.functional.normalize(self.d(doc), dim=-1)
        return {"query_emb": q, "doc_emb": d}


def build() -> nn.Module:
    return TwoTowers()


def pairs() -> DatasetSplits:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(160, 8, generator=g)
    d = q + 0.1 * torch.randn(160, 8, generator=g)
    return DatasetSplits({"query": q[:128], "doc": d[:128]}, None, {"query": q[128:], "doc": d[128:]}, None)


def contrastive(outputs: dict[str, torch.Tensor], targets: object) -> torch.Tensor:
    SEEN.append(targets)
    scores = outputs["query_emb"] @ outputs["doc_emb"].T / 0.05
    return nn.functional.cross_entropy(scores, torch.arange(len(scores)))


def _train(tmp_path: Path, **overrides: object):
    cfg = config_from_dict(
        tiny_config_dict(**{"model.name": f"{HERE}:build", "model.params": {}, "data.name": f"{HERE}:pairs"})
        | {"train": {"epochs": 3, "batch_size": 32, "compile": "off", **overrides}}
    )
    (tmp_path / "out").mkdir()
    return train_to(tmp_path / "out", settings_for(stage_named("train"), cfg), load_dataset(cfg), tmp_path / "ck")


def test_a_loss_of_the_users_trains_on_inputs_alone(tmp_path: Path) -> None:
    SEEN.clear()
    summary = _train(tmp_path, loss=f"{HERE}:contrastive")
    assert SEEN and all(t is None for t in SEEN)  # called as loss(outputs, None), in training and validation
    losses = [e["val_loss"] for e in summary.epochs]
    assert losses[-1] < losses[0] and summary.val_accuracy is None, summary.epochs


def test_no_labels_and_no_loss_is_one_error_naming_train_loss(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"has no labels \(train_y is None\)") as err:
        _train(tmp_path)
    assert "give train.loss" in (err.value.hint or "")
