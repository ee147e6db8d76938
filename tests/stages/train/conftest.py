"""Train-stage test setup: one intra-op thread (the models are tiny; two threads only contend)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _one_thread(_few_threads: None) -> Iterator[None]:
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(2)
