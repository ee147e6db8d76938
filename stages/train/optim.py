"""Optimizer and learning-rate schedule from the config, built from torch.optim's own classes."""
from __future__ import annotations

import torch
from torch import nn
from torch.optim.lr_scheduler import ConstantLR, CosineAnnealingLR, LinearLR, LRScheduler, SequentialLR

from stages.train.config import TrainConfig

WARMUP_START = 0.01  # warm-up begins at lr/100


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, object]]:
    """Weight decay on matrices and conv kernels only; biases and norm scales are not decayed."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def make_optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.Optimizer:
    fused = cfg.fused if cfg.fused is not None else device.type == "cuda"
    groups = param_groups(model, cfg.weight_decay)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, fused=fused)
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, fused=fused)


def make_schedule(opt: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int) -> LRScheduler:
    """Per-optimizer-step schedule: optional linear warm-up, then constant, cosine or linear decay."""
    warmup = min(cfg.warmup_steps, max(0, total_steps - 1))
    steps = max(1, total_steps - warmup)
    floor = min(1.0, cfg.min_lr / cfg.lr)
    main: LRScheduler
    if cfg.schedule == "cosine":
        main = CosineAnnealingLR(opt, T_max=steps, eta_min=cfg.min_lr)
    elif cfg.schedule == "linear":
        main = LinearLR(opt, start_factor=1.0, end_factor=floor, total_iters=steps)
    else:
        main = ConstantLR(opt, factor=1.0, total_iters=0)
    if warmup == 0:
        return main
    ramp = LinearLR(opt, start_factor=WARMUP_START, end_factor=1.0, total_iters=warmup)
    return SequentialLR(opt, [ramp, main], milestones=[warmup])
