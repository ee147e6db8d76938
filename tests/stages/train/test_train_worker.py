"""A torchrun worker's own checks before it trains: the data it loaded is the data Kiln's process keyed the run by."""

from __future__ import annotations

import pytest
import torch

from kiln.core.data import DatasetSplits
from kiln.core.errors import TrainingError
from kiln.pipeline.fingerprints import splits_hash
from kiln.stages.train.worker import check_same_data


def _data(seed: int) -> DatasetSplits:
    x = torch.randn(12, 4, generator=torch.Generator().manual_seed(seed))
    y = (x[:, 0] > 0).long()
    return DatasetSplits(x[:8], y[:8], x[8:], y[8:], num_classes=2)


def test_a_rank_whose_data_differs_from_kilns_own_call_is_an_error() -> None:
    """An unseeded data function gave each rank other data (overlapping shards, a leaking split), silently."""
    sources = {"user_data": {"dataset": splits_hash(_data(0))}}
    check_same_data(_data(0), sources, rank=1)  # the same data: nothing to say
    with pytest.raises(TrainingError, match="other data in training process 1 than in Kiln's own call") as err:
        check_same_data(_data(1), sources, rank=1)
    assert "seed its randomness" in err.value.hint


def test_nothing_is_compared_without_a_recorded_hash() -> None:
    """A built-in dataset has no user_data hash, and a worker started by hand has no sources."""
    check_same_data(_data(1), None, rank=0)
    check_same_data(_data(1), {"user_data": None}, rank=0)
    check_same_data(_data(1), {"code": "x"}, rank=0)
