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

import logging
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from kiln.core.cuda_graphs import capture
from kiln.core.text import first_line

log = logging.getLogger("kiln.train")


@dataclass
class StepStats:
    step: int  # global step, 1-based, as in log messages
    epoch: int  # 0-based
    samples: int
    values: torch.Tensor  # [loss, grad_norm], on the host once ``event`` has completed
    event: torch.cuda.Event | None


class LaggedStats:
    """A queue of per-step stats; ``ready()`` yields, in order, the ones at least ``lag`` steps old whose values
    have arrived, and waits for the oldest only while more than ``max_lag`` steps are queued.

    On a GPU the values go into a ring of ``max_lag + 2`` rows of pinned memory with one CUDA event per row, made
    once: at most ``max_lag + 1`` steps are queued when a step is pushed, so the row it takes is free, and a step
    costs one copy and one event record instead of a pinned allocation and a new event."""

    def __init__(self, device: torch.device, lag: int, max_lag: int = 0) -> None:
        self.device, self.lag, self.max_lag = device, lag, max(lag, max_lag)
        self.queue: deque[StepStats] = deque()
        self.pushed = 0
        self.rows: list[torch.Tensor] = []
        self.events: list[torch.cuda.Event] = []
        if device.type == "cuda":
            slots = self.max_lag + 2
            self.rows = list(torch.empty((slots, 2), pin_memory=True))
            self.events = [torch.cuda.Event() for _ in range(slots)]

    def push(self, step: int, epoch: int, samples: int, values: torch.Tensor) -> None:
        """``values``: the step's ``[loss, grad_norm]`` (:class:`StepCheck`), overwritten by the next step: copied."""
        event = None
        if values.is_cuda:
            slot = self.pushed % len(self.rows)
            host = self.rows[slot]
            host.copy_(values, non_blocking=True)  # D2H into pinned memory: queued, not waited for
            event = self.events[slot]
            event.record()
        else:
            host = values.clone()
        self.pushed += 1
        self.queue.append(StepStats(step, epoch, samples, host, event))

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


class StepCheck:
    """What a step leaves on the device for everything after it, given its loss and gradient norm:

    * ``values``: ``[loss, grad_norm]`` as one FP32 tensor, what :class:`LaggedStats` reads back;
    * ``found``: a 0-dim FP32 flag, 1.0 when either is NaN/Inf: the ``found_inf`` fused optimizers skip on;
    * the :class:`BufferGuard` settled on that flag: buffers put back when it is set, then kept for the next step.

    The flag is one kernel, the one GradScaler runs over the gradients (``torch._amp_foreach_non_finite_check_and_
    unscale_``, here with scale 1 so the values are unchanged), after one that zeroes it. Together with the guard
    that is about ten small kernels per step, and a compiled step is close to host-bound
    (``benchmarks/step_host_cost.py`` measures their host time). On a GPU they are therefore captured once as a CUDA
    graph (:func:`kiln.core.cuda_graphs.capture`) and replayed: a step pays one stack into ``values`` and one
    replay. Everything they touch is
    made once here and stays in place (the buffers are the model's own tensors), which is what a replay needs. Both
    outputs are overwritten by the next step; everything that reads them (optimizer, read-back copy) is queued on
    the same stream before it.
    """

    def __init__(self, device: torch.device, guard: BufferGuard, graph: bool = True) -> None:
        """``graph``: capture the flag and guard as a graph of their own (false where they are captured as part of
        the whole update, :mod:`kiln.stages.train.update_graph`)."""
        self.guard = guard
        self.values = torch.zeros(2, device=device)
        self.found = torch.zeros((), device=device)
        self.one = torch.ones((), device=device)
        self.graph = _capture(self._flag_and_settle, device) if device.type == "cuda" and graph else None

    def __call__(self, loss: torch.Tensor, norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        torch.stack([loss.float(), norm.float()], out=self.values)
        if self.graph is not None:
            self.graph.replay()
        else:
            self._flag_and_settle()
        return self.values, self.found

    def _flag_and_settle(self) -> None:
        self.found.zero_()
        torch._amp_foreach_non_finite_check_and_unscale_([self.values], self.found, self.one)
        self.guard.settle(self.found)


def _capture(work: Callable[[], None], device: torch.device) -> torch.cuda.CUDAGraph | None:
    """``work`` as a CUDA graph on ``device`` (:func:`kiln.core.cuda_graphs.capture`), or None where capturing
    fails: the work then runs op by op, which is slower but the same."""
    try:
        return capture(work, device)[0]
    except RuntimeError as exc:  # e.g. a buffer on another device; correctness does not depend on the graph
        log.info("the per-step check runs without a CUDA graph: %s", first_line(exc))
        return None


def skips_on_device(opt: torch.optim.Optimizer) -> bool:
    """Fused AdamW/SGD take a ``found_inf`` tensor and skip the update in the kernel (the mechanism
    GradScaler uses), so the decision needs no host round trip."""
    return bool(opt.param_groups) and all(g.get("fused") for g in opt.param_groups)


@contextmanager
def skip_if_nonfinite(opt: torch.optim.Optimizer, found: torch.Tensor) -> Iterator[None]:
    """Within the block, ``opt.step()`` leaves weights, moments and step counts untouched when ``found`` (the FP32
    flag of :class:`StepCheck`) is 1. The same optimizer attributes ``torch.amp.GradScaler.step`` sets for
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
    (running statistics), so a copy of them is kept from the end of the previous step (made here, and again by
    :meth:`save` where something outside the steps may have changed them); each step ends with :meth:`settle`:
    on the device (no host sync), the flag puts the copy back or keeps the new values, and the result is the next
    step's copy. The buffers of one dtype and device are copied with one multi-tensor copy
    (``torch._foreach_copy_``, the kernel the fused optimizers use) into views of one flat tensor made once here,
    so a step costs a few kernels and no Python work per buffer (ResNet-18 has 60 buffers). A model without
    buffers costs nothing.
    """

    def __init__(self, model: nn.Module) -> None:
        # The buffer tensors themselves: load_state_dict and .to() on the same device update them in place.
        groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for b in model.buffers():
            if b.numel():
                groups.setdefault((b.dtype, b.device), []).append(b)
        self.groups = list(groups.values())
        # Per group: the kept copy and a scratch copy, flat, and views of both shaped like the buffers
        self.saved = [_flat_like(g) for g in self.groups]
        self.scratch = [_flat_like(g) for g in self.groups]
        self.save()

    def save(self) -> None:
        """Keep the buffers as they are now (the state a skipped step goes back to)."""
        for group, (_, views) in zip(self.groups, self.saved):
            torch._foreach_copy_(views, group)

    def settle(self, found: torch.Tensor) -> None:
        """End of a step, decided on the device: where ``found`` (the flag of :class:`StepCheck`) is set the kept
        copy goes back into the buffers, else they keep their new values; either way that is the next kept copy."""
        skipped = found.bool()
        for group, (saved, saved_views), (now, now_views) in zip(self.groups, self.saved, self.scratch):
            torch._foreach_copy_(now_views, group)
            torch.where(skipped, saved, now, out=saved)  # element-wise: writing into an input is safe
            torch._foreach_copy_(group, saved_views)

    def restore(self) -> None:
        """Put the kept copy back, decided by the host (a step redone after a compile failure)."""
        for group, (_, views) in zip(self.groups, self.saved):
            torch._foreach_copy_(group, views)


def _flat_like(group: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One flat tensor as large as the group, and a view of it shaped like each of the group's tensors."""
    flat = torch.empty(sum(b.numel() for b in group), dtype=group[0].dtype, device=group[0].device)
    return flat, [part.view(b.shape) for part, b in zip(flat.split([b.numel() for b in group]), group)]
