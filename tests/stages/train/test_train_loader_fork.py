"""A DataLoader's forked workers collect none of the objects they inherit: a child that collects an ONNX Runtime
session of its parent's (garbage left for the collector) waits forever on a lock of a thread it does not have."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

from kiln.stages.train.data import forked_iter


class _Collects(Dataset):
    """Each item runs the collector in the process that loads it (a worker)."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> torch.Tensor:
        gc.collect()
        return torch.tensor([i])


class _Garbage:
    """An object in a reference cycle (only the collector frees it) that says which process freed it."""

    def __init__(self, said: Path) -> None:
        self.said, self.me = said, self

    def __del__(self) -> None:
        with open(self.said, "a") as f:
            f.write(f"{os.getpid()}\n")


def test_a_worker_collects_none_of_its_parents_garbage(tmp_path: Path) -> None:
    said = tmp_path / "freed_by"
    gc.disable()  # the cycle waits for the collector, as garbage does between two collections
    try:
        _Garbage(said)
        batches = list(forked_iter(DataLoader(_Collects(), batch_size=None, num_workers=1)))
    finally:
        gc.enable()
    assert [int(b) for b in batches] == [0, 1]
    assert said.read_text().split() == [str(os.getpid())]  # freed here, before the fork, not in the worker
