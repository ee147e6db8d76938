"""Class logits whose class axis follows the batch (a two-tower model's ``logits_per_image [images, texts]``) hold
no classes: their argmax picks a text of the batch, which no class label names. Named in signature.logits_output
beside class labels they are refused; as the default class-logit output they get no accuracy."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from torch import nn

from kiln.core.data import DatasetSplits, as_feed
from kiln.core.errors import ConfigError
from kiln.stages.accuracy.check import held_out, held_out_reference
from kiln.stages.accuracy.config import CheckConfig

NAMES = ["texts", "images"]


class TwoTower(nn.Module):
    """Texts [N, 6] and images [N, 8] -> logits_per_image [images, texts] and 4 class logits per image."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.text, self.image, self.head = nn.Linear(6, 5), nn.Linear(8, 5), nn.Linear(8, 4)

    def forward(self, texts: torch.Tensor, images: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits_per_image": self.image(images) @ self.text(texts).T, "class_logits": self.head(images)}


def _data() -> DatasetSplits:
    """Pairs of a text and an image labelled with one of 4 classes."""
    g = torch.Generator().manual_seed(1)
    x = {"texts": torch.randn(48, 6, generator=g), "images": torch.randn(48, 8, generator=g)}
    y = torch.randint(0, 4, (48,), generator=g)
    return DatasetSplits({k: v[:16] for k, v in x.items()}, y[:16], {k: v[16:] for k, v in x.items()}, y[16:], 4)


def _run(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    with torch.inference_mode():
        out = TwoTower()(**{k: torch.from_numpy(v) for k, v in feed.items()})
    return {k: v.numpy() for k, v in out.items()}


def _reference(logits: str, batch_sizes: list[int], named: bool):
    data = _data()
    feeds = held_out(data, lambda v: as_feed(v, NAMES), {}, {}, None)
    return held_out_reference(_run, feeds, data, logits, CheckConfig(), batch_sizes, {}, named=named)


def test_named_class_logits_as_long_as_the_batch_are_refused() -> None:
    """Before: accuracy was the argmax over the batch's texts against labels 0..3 (near chance), and a variant was
    rejected on its 'drop' while the run passed."""
    with pytest.raises(ConfigError) as err:
        _reference("logits_per_image", [1, 16], named=True)
    assert "class axis of output 'logits_per_image' is as long as the batch" in err.value.message
    assert "signature.logits_output" in err.value.hint and "validate.metric" in err.value.hint


def test_a_default_output_as_long_as_the_batch_gets_no_accuracy(caplog: pytest.LogCaptureFixture) -> None:
    """At a largest batch of 4 beside 4 classes the width matches the classes: only the probe at another batch size
    shows the axis is the batch's. Before: accuracy and top-1 agreement were measured on it."""
    with caplog.at_level(logging.WARNING, logger="kiln.validate"):
        ref = _reference("logits_per_image", [1, 4], named=False)
    assert ref.logits is None and ref.accuracy is None
    assert "no top-1 agreement or task accuracy is measured on it" in caplog.text


@pytest.mark.parametrize("named", [True, False])
def test_class_logits_of_as_many_classes_as_the_batch_are_scored(named: bool) -> None:
    """A head of 4 classes validated at a largest batch of 4: its class axis keeps its size at batch 1."""
    ref = _reference("class_logits", [1, 4], named=named)
    assert ref.logits == "class_logits" and ref.accuracy is not None
