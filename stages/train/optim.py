"""Optimizer and learning-rate schedule from the config, built from torch.optim's own classes."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import (
    ConstantLR,
    CosineAnnealingLR,
    LinearLR,
    LRScheduler,
    SequentialLR,
)

from kiln.core.errors import ConfigError
from kiln.stages.train.config import TrainConfig

WARMUP_START = 0.01  # warm-up begins at lr/100


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, object]]:
    """Weight decay on matrices and conv kernels only; biases and norm scales are not decayed."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def hyperparameters(cfg: TrainConfig, device: torch.device) -> dict[str, Any]:
    """The configured settings of every param group, weight decay aside (see :func:`param_groups`)."""
    common = {"lr": cfg.lr, "fused": cfg.fused if cfg.fused is not None else device.type == "cuda"}
    if cfg.optimizer == "adamw":
        return {**common, "betas": cfg.betas}
    return {**common, "momentum": cfg.momentum}


def make_optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg.weight_decay)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(groups, **hyperparameters(cfg, device))
    opt = torch.optim.SGD(groups, **hyperparameters(cfg, device))
    zero_momentum_buffers(opt)
    return opt


def zero_momentum_buffers(opt: torch.optim.Optimizer) -> None:
    """Give every SGD parameter a zeroed momentum buffer before its first step (where it has none yet).

    torch's fused SGD allocates the buffers on the first step with ``torch.empty_like`` and has the
    kernel fill them with the gradient. When that first step is skipped through ``found_inf`` (a NaN
    step, or a GradScaler overflow, common in fp16's first steps), the kernel writes nothing and the
    next step multiplies uninitialised memory by the momentum. With a zero buffer every later step is
    the ordinary ``buf = momentum * buf + (1 - dampening) * grad``, and the first one gives
    ``0 * momentum + grad = grad``: exactly torch's first step (``buf = grad``) because Kiln uses
    dampening 0 (with dampening the first step would be scaled by 1 - dampening, so it is checked).
    Idempotent: also used after loading an optimizer state that has no buffers yet."""
    if not isinstance(opt, torch.optim.SGD):
        return
    for group in opt.param_groups:
        if group["momentum"] == 0:
            continue
        assert group["dampening"] == 0, "zero buffers equal torch's first step only without dampening"
        for p in group["params"]:
            if opt.state[p].get("momentum_buffer") is None:
                opt.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def make_schedule(opt: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int) -> LRScheduler:
    """Per-optimizer-step schedule: optional linear warm-up, then constant, cosine or linear decay.
    Built on a fresh optimizer (``lr`` as configured, no ``initial_lr``): see :func:`replay_schedule`."""
    check_warmup(cfg, total_steps)
    warmup = cfg.warmup_steps
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


def check_warmup(cfg: TrainConfig, total_steps: int) -> None:
    """A warm-up as long as the run never reaches ``lr`` nor the decay; shortening it silently would train
    with a schedule nobody configured. The run length is only known here (it depends on the data)."""
    if cfg.warmup_steps and cfg.warmup_steps >= total_steps:
        raise ConfigError(
            f"train.warmup_steps is {cfg.warmup_steps} but the run has only {total_steps} optimizer steps "
            f"({cfg.epochs} epochs x {total_steps // cfg.epochs} steps): the LR would never reach train.lr",
            hint=f"set train.warmup_steps below {total_steps} (e.g. {max(0, total_steps // 10)}), "
            "or raise train.epochs",
        )


def replay_schedule(opt: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int, step: int) -> LRScheduler:
    """The schedule of the current config, advanced to ``step``: for resuming.

    Loading a checkpoint's optimizer and scheduler state brings back the old run's ``lr``, ``initial_lr``
    and schedule length, so a lowered ``train.lr`` or more epochs would do nothing (or bend a cosine back
    up). So the optimizer's hyperparameters are set from the config again (``opt`` keeps its moments and
    step counts), and a new schedule is stepped ``step`` times, as an uninterrupted run steps it.
    Replaying rather than a closed form: torch's cosine is recursive, and only the same sequence of float
    operations gives an unchanged config bit-identical learning rates. It costs about 0.3 s per 100k
    steps (2-core CPU), once."""
    device = next(p.device for g in opt.param_groups for p in g["params"])
    for group, decay in zip(opt.param_groups, (cfg.weight_decay, 0.0)):  # the order of param_groups()
        group.pop("initial_lr", None)  # else the new scheduler would setdefault() the old run's value
        group.update(hyperparameters(cfg, device), weight_decay=decay)
    sched = make_schedule(opt, cfg, total_steps)
    for _ in range(step):
        sched.step()
    return sched
