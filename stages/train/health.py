"""Per-step loss and gradient norm, read back to the host one step late so the CPU never waits on the GPU.

Reading a CUDA value with ``.item()``/``.tolist()`` right after a step blocks the CPU until the GPU has
finished that step. The GPU then sits idle while Python queues the next step's first kernels. Here each
step's ``[loss, grad_norm]`` goes into pinned host memory with a non-blocking copy and a CUDA event. The
loop looks at step t's values only after it has queued step t+1 (``lag=1``), by which time they have
almost always arrived. Waiting on the event then costs nothing, and the GPU still has step t+1 queued.

The update itself never depends on the host: a non-finite step is skipped on the device (GradScaler for
fp16, :func:`skip_if_nonfinite` for fused optimizers). So the lag only delays book-keeping: skip counting,
the loss sum and the abort. The loop drains everything (:meth:`LaggedStats.drain`) before anything that
must know every step is good, i.e. checkpoints and epoch metrics.
"""
from __future__ import annotations

from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn


@dataclass
class StepStats:
    step: int  # global step, 1-based, as in log messages
    epoch: int  # 0-based
    samples: int
    values: torch.Tensor  # [loss, grad_norm], on the host once ``event`` has completed
    event: torch.cuda.Event | None


class LaggedStats:
    """A queue of per-step stats; ``ready()`` yields the ones at least ``lag`` steps old, as floats."""

    def __init__(self, device: torch.device, lag: int) -> None:
        self.device, self.lag = device, lag
        self.queue: deque[StepStats] = deque()

    def push(self, step: int, epoch: int, samples: int, loss: torch.Tensor, norm: torch.Tensor) -> None:
        values = torch.stack([loss.float(), norm.float()])
        event = None
        if values.is_cuda:
            values = values.to("cpu", non_blocking=True)  # D2H non_blocking lands in pinned memory
            event = torch.cuda.Event()
            event.record()
        self.queue.append(StepStats(step, epoch, samples, values, event))

    def ready(self) -> Iterator[tuple[StepStats, float, float]]:
        while len(self.queue) > self.lag:
            yield self._pop()

    def drain(self) -> Iterator[tuple[StepStats, float, float]]:
        while self.queue:
            yield self._pop()

    def _pop(self) -> tuple[StepStats, float, float]:
        s = self.queue.popleft()
        if s.event is not None:
            s.event.synchronize()  # waits for this step only, not for the steps queued after it
        loss_v, norm_v = s.values.tolist()
        return s, loss_v, norm_v


def skips_on_device(opt: torch.optim.Optimizer) -> bool:
    """Fused AdamW/SGD take a ``found_inf`` tensor and skip the update in the kernel (the mechanism
    GradScaler uses), so the decision needs no host round trip."""
    return bool(opt.param_groups) and all(g.get("fused") for g in opt.param_groups)


@contextmanager
def skip_if_nonfinite(opt: torch.optim.Optimizer, loss: torch.Tensor, norm: torch.Tensor) -> Iterator[None]:
    """Within the block, ``opt.step()`` leaves weights, moments and step counts untouched when the loss
    or the gradient norm is not finite. The same optimizer attributes ``torch.amp.GradScaler.step``
    sets for fused optimizers (``grad_scale``, ``found_inf``); grad_scale None: nothing to unscale."""
    found_inf = nonfinite(loss, norm).float()
    opt.grad_scale, opt.found_inf = None, found_inf  # type: ignore[attr-defined]
    try:
        yield
    finally:
        del opt.grad_scale, opt.found_inf  # type: ignore[attr-defined]


class BufferGuard:
    """Puts the model's buffers back when a step is skipped, so a skipped step leaves the model as it was.

    The optimizer skips the update of a non-finite step, but the step's forward passes have already
    updated buffers in place: a NaN batch writes NaN into BatchNorm's running mean/variance (and bumps
    ``num_batches_tracked``), and the next good checkpoint would save them. Buffers are usually small
    (running statistics), so each step copies them before its first forward pass (:meth:`save`) and puts
    them back when the step is skipped, decided on the device (:meth:`restore_if_nonfinite`, no host
    sync) or by the host (:meth:`restore`). The buffers of one dtype and device are handled as one flat
    tensor: a few kernels per step instead of a few per buffer (ResNet-18 has 60 buffers). A model
    without buffers costs nothing.
    """

    def __init__(self, model: nn.Module) -> None:
        # The buffer tensors themselves: load_state_dict and .to() on the same device update them in place.
        groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for b in model.buffers():
            if b.numel():
                groups.setdefault((b.dtype, b.device), []).append(b)
        self.groups = list(groups.values())
        self.saved = [torch.empty(sum(b.numel() for b in g), dtype=g[0].dtype, device=g[0].device)
                      for g in self.groups]

    def save(self) -> None:
        for group, flat in zip(self.groups, self.saved):
            torch.cat([b.reshape(-1) for b in group], out=flat)

    def restore_if_nonfinite(self, loss: torch.Tensor, norm: torch.Tensor) -> None:
        """Decided on the device (no host sync): the step is skipped iff its loss or gradient norm is
        NaN/Inf, the condition the optimizer/GradScaler skip on; otherwise the buffers keep their values."""
        if not self.groups:
            return
        skipped = nonfinite(loss, norm)
        for group, flat in zip(self.groups, self.saved):
            now = torch.cat([b.reshape(-1) for b in group])
            torch.where(skipped, flat, now, out=now)
            _unflatten_into(group, now)

    def restore(self) -> None:
        for group, flat in zip(self.groups, self.saved):
            _unflatten_into(group, flat)


def _unflatten_into(group: list[torch.Tensor], flat: torch.Tensor) -> None:
    parts = flat.split([b.numel() for b in group])
    torch._foreach_copy_(group, [p.view(b.shape) for p, b in zip(parts, group)])


def nonfinite(loss: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool on the device: is this step's loss or gradient norm NaN/Inf (the step is skipped)?"""
    return ~torch.isfinite(loss) | ~torch.isfinite(norm)
