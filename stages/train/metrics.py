"""What the loop measures per epoch, the JSON summary the stage returns, and the loss-curve plot."""

from __future__ import annotations

import logging
import resource
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("kiln.train")


@dataclass
class EpochMetrics:
    epoch: int
    loss: float  # mean training loss over the epoch's samples (all processes); NaN if no step was finite
    samples_per_s: float  # training samples per second, validation excluded
    steps: int  # optimizer steps in the epoch
    lr: float  # learning rate at the end of the epoch
    val_loss: float | None = None
    val_accuracy: float | None = None
    peak_memory_mb: float | None = None  # CUDA: max allocated this epoch; CPU: process peak RSS so far
    loss_scale: float | None = None  # fp16 only
    skipped_steps: int = 0  # fp16 steps skipped for overflowing gradients
    nonfinite_steps: int = 0  # steps skipped for a NaN/Inf loss


@dataclass
class TrainResult:
    history: list[EpochMetrics] = field(default_factory=list)
    precision: str = "fp32"
    device: str = "cpu"
    world_size: int = 1
    global_step: int = 0
    best_epoch: int | None = None
    best_val_accuracy: float | None = None
    best_val_loss: float | None = None  # where epochs are ranked by it (no classes, no accuracy)
    best_by: str | None = None  # what ranked the epochs: "val_accuracy", or "val_loss" where there is no accuracy
    selected_epoch: int | None = None  # the epoch whose weights were returned (checkpoint.select)
    resumed_from: str | None = None
    checkpoint_dir: str | None = None
    fp32_norms: list[str] = field(default_factory=list)
    compile: dict[str, Any] | None = None  # torch.compile settings and counts (compile.CompiledModel.summary)
    update_graph: dict[str, Any] | None = None  # the update's CUDA graph (update_graph.GraphedUpdate.summary)
    files: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        """JSON-able: goes into the stage manifest and report.json (``kiln.stages.train.summary``)."""
        last = self.history[-1] if self.history else None
        chosen = self.selected()
        return {
            "precision": self.precision,
            "device": self.device,
            "world_size": self.world_size,
            "steps": self.global_step,
            "epochs": [asdict(m) for m in self.history],
            "final_loss": last.loss if last else None,
            # of the weights actually returned (and saved as model.safetensors): with select: best, the
            # best epoch's, not the last epoch's
            "val_accuracy": chosen.val_accuracy if chosen else None,
            "val_loss": chosen.val_loss if chosen else None,
            "selected_epoch": chosen.epoch if chosen else None,
            "best_val_accuracy": self.best_val_accuracy,
            "best_epoch": self.best_epoch,
            "best_val_loss": self.best_val_loss,
            "best_by": self.best_by,
            "skipped_steps": sum(m.skipped_steps for m in self.history),
            "nonfinite_steps": sum(m.nonfinite_steps for m in self.history),
            "samples_per_s": last.samples_per_s if last else None,
            "peak_memory_mb": max((m.peak_memory_mb or 0.0) for m in self.history) if self.history else None,
            "resumed_from": self.resumed_from,
            "checkpoint_dir": self.checkpoint_dir,
            "fp32_norm_layers": len(self.fp32_norms),
            "compile": self.compile,
            "update_graph": self.update_graph,
            "files": self.files,
        }

    def selected(self) -> EpochMetrics | None:
        """Metrics of the returned weights' epoch: the selected one, else the last evaluated one."""
        by_epoch = {m.epoch: m for m in self.history}
        if self.selected_epoch in by_epoch:
            return by_epoch[self.selected_epoch]
        evaluated = [m for m in self.history if m.val_accuracy is not None]
        return evaluated[-1] if evaluated else None


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # CPU has no per-epoch allocator statistics; the process's peak resident set is the honest figure.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


def plot_loss(history: list[EpochMetrics], path: Path, title: str) -> None:
    """Train (and validation) loss per epoch as a PNG; matplotlib's Agg backend, no display needed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 3.5), dpi=100)
    FigureCanvasAgg(fig)  # the Agg canvas explicitly: no pyplot, no global backend switch
    ax = fig.add_subplot()
    epochs = [m.epoch for m in history]
    ax.plot(epochs, [m.loss for m in history], marker="o", label="train loss")
    val = [(m.epoch, m.val_loss) for m in history if m.val_loss is not None]
    if val:
        ax.plot(*zip(*val), marker="s", label="val loss")
    ax.set_xlabel("epoch")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    # fixed margins, in inches: fitting them (tight_layout) measures every label's text, most of the render's time
    width, height = fig.get_size_inches()
    fig.subplots_adjust(left=0.9 / width, right=1 - 0.15 / width, bottom=0.55 / height, top=1 - 0.4 / height)
    fig.savefig(path, metadata={"Software": None})  # no version string: same curve, same bytes
