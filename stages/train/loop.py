"""The training loop: autocast, scaled backward, unscale, clip, step, update — in that order.

fp16 uses a GradScaler (dynamic loss scaling); bf16 and fp32 run with the scaler disabled. Parameters stay
FP32 (master weights); autocast only lowers the precision of eligible ops, and norm layers run in FP32.
"""
from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from models.datasets import DatasetSplits
from pipeline.errors import TrainingError
from pipeline.progress import Progress, SilentProgress
from stages.train.config import TrainConfig


@dataclass
class EpochMetrics:
    epoch: int
    loss: float
    val_accuracy: float
    samples_per_s: float
    loss_scale: float | None = None
    skipped_steps: int = 0


@dataclass
class TrainResult:
    history: list[EpochMetrics] = field(default_factory=list)
    precision: str = "fp32"
    device: str = "cpu"

    def summary(self) -> dict[str, Any]:
        last = self.history[-1] if self.history else None
        return {
            "precision": self.precision,
            "device": self.device,
            "epochs": [vars(m) for m in self.history],
            "final_loss": last.loss if last else None,
            "val_accuracy": last.val_accuracy if last else None,
        }


def resolve_device(cfg: TrainConfig) -> torch.device:
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise TrainingError("train.device is 'cuda' but no CUDA GPU is visible", hint="set train.device: cpu or auto")
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(cfg.device)


def resolve_precision(cfg: TrainConfig, device: torch.device) -> str:
    if cfg.precision != "auto":
        return cfg.precision
    return "fp16" if device.type == "cuda" else "bf16"


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device, batch: int = 256) -> float:
    model.eval()
    correct = 0
    for i in range(0, len(x), batch):
        correct += (model(x[i:i + batch].to(device)).argmax(-1).cpu() == y[i:i + batch]).sum().item()
    model.train()
    return correct / max(1, len(x))


def train(model: nn.Module, data: DatasetSplits, cfg: TrainConfig, seed: int = 0,
          progress: Progress | None = None) -> TrainResult:
    progress = progress or SilentProgress()
    torch.manual_seed(seed)
    device = resolve_device(cfg)
    precision = resolve_precision(cfg, device)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
    model.to(device).train()
    opt = (torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay) if cfg.optimizer == "adamw"
           else torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9, weight_decay=cfg.weight_decay))
    micro = max(1, cfg.batch_size // cfg.grad_accum_steps)
    steps_per_epoch = math.ceil(len(data.train_x) / cfg.batch_size)
    total_steps = steps_per_epoch * cfg.epochs
    sched = (torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total_steps) if cfg.schedule == "cosine" else None)
    scaler = torch.amp.GradScaler(device.type, enabled=(precision == "fp16"))
    loss_fn = nn.CrossEntropyLoss()
    result = TrainResult(precision=precision, device=str(device))
    gen = torch.Generator().manual_seed(seed)

    with progress.task("training", total=cfg.epochs) as bar:
        for epoch in range(cfg.epochs):
            t0, seen, loss_sum, skipped = time.perf_counter(), 0, 0.0, 0
            perm = torch.randperm(len(data.train_x), generator=gen)
            for start in range(0, len(perm), cfg.batch_size):
                idx = perm[start:start + cfg.batch_size]
                chunks = idx.split(micro)
                for chunk in chunks:
                    xb, yb = data.train_x[chunk].to(device), data.train_y[chunk].to(device)
                    ctx = torch.autocast(device.type, dtype=dtype) if dtype is not None else nullcontext()
                    with ctx:
                        logits = model(xb)
                    # The loss in FP32, weighted by the micro-batch's share so K chunks equal one big batch.
                    loss = loss_fn(logits.float(), yb) * (len(chunk) / len(idx))
                    if not torch.isfinite(loss):
                        raise TrainingError(f"non-finite loss ({loss.item()}) at epoch {epoch + 1}",
                                            hint="lower train.lr, or use train.precision: fp32/bf16")
                    scaler.scale(loss).backward()
                    loss_sum += loss.item() * len(idx)
                scaler.unscale_(opt)  # clip true gradients, not scaled ones
                if cfg.grad_clip is not None:
                    nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                scale_before = scaler.get_scale()
                scaler.step(opt)
                scaler.update()
                if precision == "fp16" and scaler.get_scale() < scale_before:
                    skipped += 1  # the scaler skipped this step: gradients overflowed
                opt.zero_grad(set_to_none=True)
                if sched is not None:
                    sched.step()
                seen += len(idx)
            acc = evaluate(model, data.val_x, data.val_y, device)
            m = EpochMetrics(epoch + 1, loss_sum / max(1, seen), acc, seen / (time.perf_counter() - t0),
                             scaler.get_scale() if precision == "fp16" else None, skipped)
            result.history.append(m)
            bar.advance(1, note=f"loss {m.loss:.3f} acc {acc:.3f}")
    model.to("cpu").eval()
    return result
