"""Train-stage test setup: one intra-op thread (the models are tiny; two threads only contend)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread(_few_threads: None) -> Iterator[None]:
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(2)
