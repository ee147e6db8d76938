"""Tiny models and data for the train-stage tests: a few hundred parameters, a few hundred samples."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kiln.core.data import DatasetSplits
from kiln.models.datasets import synthetic
from kiln.stages.train.config import TrainConfig


class TinyNet(nn.Module):
    """Linear + LayerNorm + GELU + Linear on [B, 1, 8, 8]: no BatchNorm and no dropout, so a batch's update
    does not depend on how it is split (BatchNorm statistics would)."""

    def __init__(self, hidden: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(64, hidden), nn.LayerNorm(hidden), nn.GELU(), nn.Linear(hidden, classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def tiny_net(seed: int = 0) -> TinyNet:
    torch.manual_seed(seed)
    return TinyNet()


def bn_net(seed: int = 0) -> nn.Sequential:
    """Linear + BatchNorm: running statistics that every training forward pass updates in place."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 10))


def nan_inside(layer: nn.Module, calls: set[int]) -> None:
    """Make ``layer``'s output NaN on those training-mode calls (1-based): a blow-up inside the network,
    before the layers after it (e.g. BatchNorm) have seen the batch."""
    n = {"calls": 0}

    def hook(m: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor | None:
        if not m.training:
            return None
        n["calls"] += 1
        return out * float("nan") if n["calls"] in calls else None

    layer.register_forward_hook(hook)


def nan_on_forward(model: nn.Module, call: int) -> None:
    """Make the ``call``-th training-mode forward pass of ``model`` return NaNs (a one-step loss blow-up)."""
    calls = {"n": 0}
    orig = model.forward

    def forward(inp: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        out = orig(inp)
        return out * float("nan") if model.training and calls["n"] == call else out

    model.forward = forward  # type: ignore[method-assign]


def tiny_data(size: int = 200) -> DatasetSplits:
    return synthetic(size=size, val_fraction=0.2, seed=3)


def train_cfg(**kw: Any) -> TrainConfig:
    base: dict[str, Any] = {
        "epochs": 2,
        "batch_size": 32,
        "precision": "fp32",
        "device": "cpu",
        "plot": False,
        "lr": 0.05,
        "optimizer": "sgd",
        "checkpoint": {"resume": "never"},
    }
    for key, value in kw.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return TrainConfig.model_validate(base)


def max_diff(a: nn.Module, b: nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    return max((sa[k].float() - sb[k].float()).abs().max().item() for k in sa)


class Crash(Exception):
    """A simulated crash inside the training loop (kill -9 stands-in for resume tests)."""


def crash_at(step: int):
    """An ``on_step`` hook that raises :class:`Crash` after global step ``step``."""

    def hook(global_step: int) -> None:
        if global_step == step:
            raise Crash(f"simulated crash after step {step}")

    return hook


class AuxHead(nn.Module):
    """Two outputs, of which the default cross-entropy reads only ``logits``: ``aux`` gets no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 10)
        self.aux = nn.Linear(64, 2)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        x = x.flatten(1)
        return {"logits": self.a(x), "aux": self.aux(x)}


def aux_head() -> AuxHead:
    return AuxHead()
