"""Integer labels of several targets per sample (a multi-task text model's ``[N, 2]``: a topic and a sentiment
class) beside class logits of one row per sample: not labels per position, whatever their rank."""

from __future__ import annotations

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
from kiln.stages.train.task import Task, task_for
from tests.conftest import tiny_config_dict

REF = "tests.stages.train.test_train_targets_per_sample"


class MultiTask(nn.Module):
    """Tokens [N, T] and a padding mask -> {"heads": {"topic": [N, 5], "sentiment": [N, 3]}, "aux": [pooled [N, 8],
    token states [N, T, 8]]}."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.topic, self.sentiment = nn.Embedding(20, 8), nn.Linear(8, 5), nn.Linear(8, 3)

    def forward(self, tokens: torch.Tensor, padding_mask: torch.Tensor) -> dict:
        h = torch.tanh(self.emb(tokens))
        keep = (~padding_mask).unsqueeze(-1).to(h.dtype)
        pooled = (h * keep).sum(1) / keep.sum(1).clamp(min=1.0)
        return {"heads": {"topic": self.topic(pooled), "sentiment": self.sentiment(pooled)}, "aux": [pooled, h]}


def build() -> nn.Module:
    return MultiTask()


def load() -> DatasetSplits:
    """48 texts of 12 tokens (the last 4 padding in every other one), labelled (topic, sentiment)."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, 20, (48, 12), generator=g)
    mask = torch.zeros(48, 12, dtype=torch.bool)
    mask[::2, 8:] = True
    y = torch.stack([torch.randint(0, 5, (48,), generator=g), torch.randint(0, 3, (48,), generator=g)], 1)
    x = {"tokens": tokens.masked_fill(mask, 0), "padding_mask": mask}
    return DatasetSplits(
        {k: v[:32] for k, v in x.items()}, y[:32], {k: v[32:] for k, v in x.items()}, y[32:], num_classes=5
    )


def _config(**overrides: object) -> object:
    return config_from_dict(
        tiny_config_dict(
            **{
                "model": {"name": f"{REF}:build"},
                "data": {"name": f"{REF}:load"},
                "signature.logits_output": "heads.topic",
                "signature.dynamic_axes": {"tokens": {1: "seq"}, "padding_mask": {1: "seq"}},
                "train.batch_size": 16,
                **overrides,
            }
        )
    )


def test_targets_per_sample_of_a_model_not_trained_here_stop_nothing(tmp_path: Path) -> None:
    """train.enabled: false with no train.loss: the labels are no labels per position of the pooled logits (their
    axis 1, 2 long, is no position axis of the model); the untrained model is scored, with no accuracy."""
    result = Runner(_config(**{"train.enabled": False}), tmp_path / "wd", STAGES).run(stop="train")
    assert result.ok, result.error
    assert result.records[0].status == "skipped" and result.records[0].summary.val_accuracy is None


def test_targets_per_sample_without_train_loss_are_refused_with_a_fix_naming_it() -> None:
    """Training with the built-in cross-entropy, which reads one class per sample: the error says the labels hold
    two targets per sample and its fix names train.loss and validate.metric."""
    data = load()
    with pytest.raises(ModelError, match=r"labels of shape \(2, 2\): 2 targets per sample") as caught:
        check_model_fits_data(build(), data, "mt:build", task_for(data, None, "heads.topic"), "heads.topic")
    assert "train.loss" in caught.value.hint and "validate.metric" in caught.value.hint


def test_token_labels_beside_pooled_logits_stay_labels_per_position() -> None:
    """Labels [N, T] beside the pooled logits of a model whose token states have the tokens' axis: labels per
    position for which the model gives no logits, the error as before."""
    data, tags = load(), torch.randint(0, 5, (48, 12), generator=torch.Generator().manual_seed(1))
    data = DatasetSplits(data.train_x, tags[:32], data.val_x, tags[32:], num_classes=5)
    with pytest.raises(ModelError, match="a label per position needs logits"):
        check_model_fits_data(build(), data, "mt:build", Task("classification", "heads.topic"), "heads.topic")


class Pooled(nn.Module):
    """Only the pooled topic logits [N, 5]: no output with the tokens' axis."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = MultiTask()

    def forward(self, tokens: torch.Tensor, padding_mask: torch.Tensor) -> torch.Tensor:
        return self.inner(tokens, padding_mask)["heads"]["topic"]


def test_token_labels_beside_a_model_of_pooled_logits_alone_follow_the_tokens_length() -> None:
    """Labels [N, T] as long as the token ids, the model's one output pooled: labels per token (the tokens' length
    says so), the per-position error and not 'targets per sample'."""
    data, tags = load(), torch.randint(0, 5, (48, 12), generator=torch.Generator().manual_seed(1))
    data = DatasetSplits(data.train_x, tags[:32], data.val_x, tags[32:], num_classes=5)
    with pytest.raises(ModelError, match="a label per position needs logits"):
        check_model_fits_data(Pooled(), data, "mt:pooled", Task("classification"), None)


def test_a_head_narrower_than_the_widest_target_column_is_no_class_count_error() -> None:
    """The sentiment head has 3 classes, the topic column 5 (the dataset's num_classes): targets per sample, so no
    class count is checked against the head; a model not trained here is not stopped, training names train.loss."""
    from kiln.stages.train.task import scoring_task

    data = load()
    task = scoring_task(data, None, "heads.sentiment")
    assert task is not None
    check_model_fits_data(build(), data, "mt:build", task, "heads.sentiment")
    with pytest.raises(ModelError, match="2 targets per sample"):
        check_model_fits_data(build(), data, "mt:build", task_for(data, None, "heads.sentiment"), "heads.sentiment")


class Frames(nn.Module):
    """Float frames [N, T, F] pooled to one row of class logits: no output keeps the frames' axis."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x.mean(1))


def test_labels_per_frame_of_float_inputs_stay_labels_per_position() -> None:
    """Labels [N, T] as long as float frames' axis: labels per frame the pooled model gives no logits for."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 50, 16, generator=g), torch.randint(0, 5, (40, 50), generator=g)
    data = DatasetSplits(x[:32], y[:32], x[32:], y[32:], num_classes=5)
    with pytest.raises(ModelError, match="a label per position needs logits"):
        check_model_fits_data(Frames(), data, "frames:build", Task("classification"), None)
