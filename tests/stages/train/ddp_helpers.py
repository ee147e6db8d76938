"""One process against two torchrun processes with the same global batch: what the gloo (CPU) and NCCL (GPU)
equality tests share."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from kiln.pipeline.config import KilnConfig
from kiln.pipeline.runner import load_dataset, settings_for
from kiln.pipeline.stage_list import stage_named
from kiln.stages.train.launch import run_torchrun
from kiln.stages.train.stage import train_to

LOG = logging.getLogger("test")


@dataclass
class OneVsTwo:
    single: dict[str, Any]  # train summaries
    multi: dict[str, Any]
    one: Path  # their output folders
    two: Path
    weights_one: dict[str, torch.Tensor]
    weights_two: dict[str, torch.Tensor]

    def max_weight_diff(self) -> float:
        return max((self.weights_one[k] - self.weights_two[k]).abs().max().item() for k in self.weights_one)


def train_one_and_two(tmp_path: Path, config: Callable[[int], KilnConfig]) -> OneVsTwo:
    """``config(nproc)``: the same run for 1 and for 2 processes. One in-process, two through torchrun."""
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    train = stage_named("train")
    single = train_to(one, settings_for(train, config(1)), load_dataset(config(1)), tmp_path / "ck1")
    multi = run_torchrun(settings_for(train, config(2)), two, tmp_path / "ck2", LOG)
    return OneVsTwo(
        single.model_dump(),
        multi,
        one,
        two,
        load_file(str(one / "model.safetensors")),
        load_file(str(two / "model.safetensors")),
    )
