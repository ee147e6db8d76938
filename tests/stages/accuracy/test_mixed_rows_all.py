"""The batch-coupling probe runs rows of the probe batch alone: a row other than the last may be the one whose
answer changes with its batch mates."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from kiln.core.data import as_feed, from_feed
from kiln.core.outputs import host_arrays, named_outputs
from kiln.stages.accuracy.check import batch_coupled, mixed_rows, probed_rows


class BatchMeanBranch(nn.Module):
    """Doubles its input where the whole batch's mean is positive, else subtracts 1: each row's answer reads every
    row of the batch through ``torch.cond``'s predicate."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cond(x.mean() > 0, lambda t: t * 2.0, lambda t: t - 1.0, (x,))


def _run(model: nn.Module, like: torch.Tensor) -> object:
    """The model as the validate stage's reference runs it: a feed in, named numpy outputs out."""

    def run(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with torch.inference_mode():
            return host_arrays(named_outputs(model, from_feed(feed, like)))

    return run


def _rows() -> torch.Tensor:
    """32 rows of 4 features, each row's mean positive but two in the middle's: a batch of any 16 of them has a
    positive mean, so only those two rows take the other branch alone, and the last row agrees."""
    x = torch.rand(32, 4, generator=torch.Generator().manual_seed(0)) + 0.5
    x[5] = x[20] = -2.0
    return x


def test_a_middle_row_that_branches_otherwise_alone_marks_the_output_batch_coupled() -> None:
    """Only the last row used to run alone; it agreed, and the model was packaged batched."""
    x = _rows()
    run = _run(BatchMeanBranch().eval(), x)
    feed = as_feed(x, ["x"])
    assert batch_coupled(run, feed, 16, 1) == ["logits"]
    batch = {"x": feed["x"][:16]}
    assert mixed_rows(run, batch, run(batch)) == ["logits"]


def test_a_model_whose_rows_are_their_own_is_not_coupled() -> None:
    x = _rows()
    run = _run(nn.Sequential(nn.Linear(4, 3), nn.ReLU()).eval(), x)
    assert batch_coupled(run, as_feed(x, ["x"]), 16, 1) == []


def test_the_rows_run_alone_are_bounded_and_spread_over_the_batch() -> None:
    """Every row of a small batch; of a large one, a bounded number from its first row to its last."""
    assert probed_rows(5) == [0, 1, 2, 3, 4]
    many = probed_rows(1000)
    assert len(many) == 16 and many[0] == 0 and many[-1] == 999 and many == sorted(set(many))


def test_a_sample_the_batch_repeats_runs_alone_once() -> None:
    """A probe batch made by repeating few held-out rows (four samples, each four times): each sample runs alone
    once, not once per copy."""
    model = nn.Linear(4, 2)
    x = torch.rand(4, 4, generator=torch.Generator().manual_seed(0)).repeat(4, 1)
    run = _run(model, x)
    calls: list[int] = []

    def counted(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        calls.append(len(next(iter(feed.values()))))
        return run(feed)

    feed = as_feed(x, ["input"])
    assert mixed_rows(counted, feed, run(feed)) == [] and calls == [1, 1, 1, 1]
