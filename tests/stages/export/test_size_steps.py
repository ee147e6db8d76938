"""The step probe runs each size on a copy of the model: a model that changes itself at a size (Hugging Face's Swin
shrinks its window for an image smaller than it) keeps the state it was trained in for the export, and the sizes
probed after that one are answered by the model as it was."""

from __future__ import annotations

import torch
from torch import nn

from kiln.core.data import DatasetSplits
from kiln.core.records import takes_size
from kiln.stages.export.size_steps import size_steps


class ShrinkingWindow(nn.Module):
    """Takes lengths that are a multiple of its window, and shrinks the window to a shorter length it is given
    (as Swin's ``set_shift_and_window_size``): after a length of 2, it takes every even length."""

    def __init__(self) -> None:
        super().__init__()
        self.window = 4
        self.lin = nn.Linear(1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] < self.window:
            self.window = x.shape[-1]
        windows = x.reshape(len(x), -1, self.window)  # fails where the length is no multiple of the window
        return self.lin(windows.mean(-1, keepdim=True)).flatten(1)


def test_sizes_are_probed_on_copies_that_leave_the_model_as_it_was() -> None:
    x = torch.rand(4, 16)
    model = ShrinkingWindow().eval()
    steps = size_steps(model, DatasetSplits(x, None, x, None), ["input"], {"input": {1: "n"}}, {"n": [2, 16]})
    assert model.window == 4  # the model the export traces is the trained one
    taken = [n for n in range(2, 17) if takes_size(steps["n"], n)]
    assert taken == [2, 3, 4, 8, 12, 16]  # those that shrink its window, and the multiples of 4: no size changed 6's
