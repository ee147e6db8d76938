"""PyTorch failing at a listed ``signature.shapes`` minimum below the data's own size, where the model takes every
size from a smallest up (:func:`kiln.stages.export.torch_sizes.torch_at`): the fix names that smallest size and
keeps the listed maximum, rather than blaming Kiln's cutting and suggesting only the data's own sizes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from kiln.core.data import from_feed
from kiln.core.errors import ModelError
from kiln.core.shapes import resize
from kiln.stages.export.torch_sizes import torch_at


class _Convs(nn.Module):
    """Two unpadded convolutions of kernel 10, stride 5 over audio [N, samples]: they take 55 samples and more."""

    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.Sequential(nn.Conv1d(1, 2, 10, stride=5), nn.Conv1d(2, 2, 10, stride=5))

    def forward(self, audio: torch.Tensor) -> torch.Tensor:
        return self.convs(audio.unsqueeze(1)).mean(-1)


class _Gap(nn.Module):
    """A model that takes 20 samples and more, except 37: no smallest size from which it takes every one."""

    def forward(self, audio: torch.Tensor) -> torch.Tensor:
        if audio.shape[1] < 20 or audio.shape[1] == 37:
            raise ValueError(f"cannot take {audio.shape[1]} samples")
        return audio.mean(1, keepdim=True)


def _error(model: nn.Module, listed: list[int]) -> ModelError:
    feed = {"audio": np.random.default_rng(0).random((2, 200), dtype=np.float32)}
    axes = {"audio": {1: "samples"}}
    point = {"samples": listed[0]}
    like = {k: torch.from_numpy(v) for k, v in feed.items()}
    with pytest.raises(ModelError) as err:
        torch_at(model.eval(), from_feed(resize(feed, axes, point), like), point, [feed] * 3, axes, {"samples": listed})
    return err.value


def test_a_listed_minimum_below_the_smallest_size_the_model_takes_names_that_size() -> None:
    err = _error(_Convs(), [8, 400])
    hint = err.hint or ""
    assert hint.startswith("the model takes samples from 55 up (at 8: "), hint
    assert hint.endswith("signature.shapes: {samples: [55, 400]}"), hint
    assert "cutting" not in hint


def test_a_model_failing_above_the_smallest_size_it_takes_keeps_the_other_hints() -> None:
    hint = _error(_Gap(), [8, 37, 400]).hint or ""
    assert "from 20 up" not in hint, hint
