"""Per-step loss and gradient norm, read back to the host late so the CPU never waits on the GPU.

Reading a CUDA value with ``.item()``/``.tolist()`` right after a step blocks the CPU until the GPU has
finished that step. The GPU then sits idle while Python queues the next step's first kernels. Here each
step's ``[loss, grad_norm]`` goes into pinned host memory with a non-blocking copy and a CUDA event. The
loop looks at step t's values once they have arrived (the event has completed, asked without waiting) and
t+1 is queued (``lag=1``); it waits only when the host has run ``max_lag`` steps ahead of the values. A
fixed wait on step t-1 at the end of step t would cap how far the host may run ahead of the GPU at about
one step: with steps whose host time is close to their GPU time, every bit of host jitter (a slow launch, the
OS) then idles the GPU, where a deeper queue absorbs it, as in a bare loop without any read-back.

The update itself never depends on the host: a non-finite step is skipped on the device (GradScaler for
fp16, :func:`skip_if_nonfinite` for fused optimizers). So the lag only delays book-keeping: skip counting,
the loss sum and the abort (by at most ``max_lag`` steps). The loop drains everything
(:meth:`LaggedStats.drain`) before anything that must know every step is good, i.e. checkpoints and epoch
metrics.
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
    """A queue of per-step stats; ``ready()`` yields, in order, the ones at least ``lag`` steps old whose values
    have arrived, and waits for the oldest only while more than ``max_lag`` steps are queued."""

    def __init__(self, device: torch.device, lag: int, max_lag: int = 0) -> None:
        self.device, self.lag, self.max_lag = device, lag, max(lag, max_lag)
        self.queue: deque[StepStats] = deque()

    def push(self, step: int, epoch: int, samples: int, values: torch.Tensor) -> None:
        """``values``: the step's ``[loss, grad_norm]`` (:func:`step_values`), on the device."""
        event = None
        if values.is_cuda:
            values = values.to("cpu", non_blocking=True)  # D2H non_blocking lands in pinned memory
            event = torch.cuda.Event()
            event.record()
        self.queue.append(StepStats(step, epoch, samples, values, event))

    def ready(self) -> Iterator[tuple[StepStats, float, float]]:
        while len(self.queue) > self.max_lag or (len(self.queue) > self.lag and self._arrived(self.queue[0])):
            yield self._pop()

    def drain(self) -> Iterator[tuple[StepStats, float, float]]:
        while self.queue:
            yield self._pop()

    @staticmethod
    def _arrived(s: StepStats) -> bool:
        return s.event is None or s.event.query()  # cudaEventQuery: asks, never waits

    def _pop(self) -> tuple[StepStats, float, float]:
        s = self.queue.popleft()
        if s.event is not None:
            s.event.synchronize()  # waits for this step only, not for the steps queued after it
        loss_v, norm_v = s.values.tolist()
        return s, loss_v, norm_v


def step_values(loss: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
    """``[loss, grad_norm]`` as one FP32 tensor: what is read back and what the non-finite check looks at."""
    return torch.stack([loss.float(), norm.float()])


class NonFiniteCheck:
    """Is a step's loss or gradient norm NaN/Inf? Answered on the device, as a 0-dim FP32 flag (1.0: skip).

    One kernel, the one GradScaler runs over the gradients (``torch._amp_foreach_non_finite_check_and_unscale_``,
    here with scale 1 so the values are unchanged), after one that zeroes the flag, where ``~isfinite(loss) |
    ~isfinite(norm)`` is a chain of element-wise kernels on each value: each small kernel costs the host a launch
    every step, and compiled steps are close to host-bound. The flag is what fused optimizers read as ``found_inf``. It is one tensor reused every
    step: everything that reads it (optimizer, :class:`BufferGuard`) is queued on the same stream before the next
    step zeroes it."""

    def __init__(self, device: torch.device) -> None:
        self.found = torch.zeros((), device=device)
        self.one = torch.ones((), device=device)

    def __call__(self, values: torch.Tensor) -> torch.Tensor:
        self.found.zero_()
        torch._amp_foreach_non_finite_check_and_unscale_([values], self.found, self.one)
        return self.found


def skips_on_device(opt: torch.optim.Optimizer) -> bool:
    """Fused AdamW/SGD take a ``found_inf`` tensor and skip the update in the kernel (the mechanism
    GradScaler uses), so the decision needs no host round trip."""
    return bool(opt.param_groups) and all(g.get("fused") for g in opt.param_groups)


@contextmanager
def skip_if_nonfinite(opt: torch.optim.Optimizer, found: torch.Tensor) -> Iterator[None]:
    """Within the block, ``opt.step()`` leaves weights, moments and step counts untouched when ``found`` (the FP32
    flag of :class:`NonFiniteCheck`) is 1. The same optimizer attributes ``torch.amp.GradScaler.step`` sets for
    fused optimizers (``grad_scale``, ``found_inf``); grad_scale None: nothing to unscale."""
    opt.grad_scale, opt.found_inf = None, found  # type: ignore[attr-defined]
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
    sync) or by the host (:meth:`restore`). The buffers of one dtype and device are copied with one
    multi-tensor copy (``torch._foreach_copy_``, the kernel the fused optimizers use) into views of one flat
    tensor made once here, so a step costs a few kernel launches and no Python work per buffer (ResNet-18 has
    60 buffers). A model without buffers costs nothing.
    """

    def __init__(self, model: nn.Module) -> None:
        # The buffer tensors themselves: load_state_dict and .to() on the same device update them in place.
        groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for b in model.buffers():
            if b.numel():
                groups.setdefault((b.dtype, b.device), []).append(b)
        self.groups = list(groups.values())
        # Per group: the saved copy and a scratch copy, flat, and views of both shaped like the buffers
        self.saved = [_flat_like(g) for g in self.groups]
        self.scratch = [_flat_like(g) for g in self.groups]

    def save(self) -> None:
        for group, (_, views) in zip(self.groups, self.saved):
            torch._foreach_copy_(views, group)

    def restore_if_nonfinite(self, found: torch.Tensor) -> None:
        """Decided on the device (no host sync): ``found`` (the flag of :class:`NonFiniteCheck`, the condition the
        optimizer/GradScaler skip on) puts the saved values back; else buffers keep theirs."""
        skipped = found.bool()
        for group, (saved, _), (now, now_views) in zip(self.groups, self.saved, self.scratch):
            torch._foreach_copy_(now_views, group)
            torch.where(skipped, saved, now, out=now)
            torch._foreach_copy_(group, now_views)

    def restore(self) -> None:
        for group, (_, views) in zip(self.groups, self.saved):
            torch._foreach_copy_(group, views)


def _flat_like(group: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One flat tensor as large as the group, and a view of it shaped like each of the group's tensors."""
    flat = torch.empty(sum(b.numel() for b in group), dtype=group[0].dtype, device=group[0].device)
    return flat, [part.view(b.shape) for part, b in zip(flat.split([b.numel() for b in group]), group)]
