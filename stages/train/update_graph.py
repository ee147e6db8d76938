"""The update after the backward pass as one CUDA graph (``train.update_graph``).

After the backward pass a step unscales the gradients (fp16), clips them, checks the loss and norm
(:class:`kiln.stages.train.health.StepCheck`), runs the fused optimizer (which skips a non-finite step on the
device), updates the loss scale and zeroes the gradients: a dozen multi-tensor kernels, but milliseconds of Python
and launch time on the host for a model with hundreds of parameter tensors, and a compiled training step is close to
host-bound. Nothing in the update needs the host, so it is captured once with ``torch.cuda.graph`` and replayed:
PyTorch's "partial-network capture" of the optimizer step, here around the whole update, GradScaler included.

What a replay needs, and how it is kept:

* The same tensors every step. Each step's gradients and loss are copied into buffers the graph reads (with
  torch.compile's CUDA graphs, which keep ``.grad`` allocated, it reads ``.grad`` itself); the optimizer state, the
  loss scale and the buffer guard's copies are updated in place by their own code. The first steps run eagerly
  (``WARMUP_STEPS``): the optimizer creates its state and DDP rebuilds its buckets in them. A step whose gradients do
  not fit the graph (a parameter the forward pass did not use) runs eagerly; when that lasts, the update is captured
  again.
* The learning rate as a tensor: a Python float would be baked into the graph. Before each replay the schedule's
  floats are written into one device tensor per parameter group, which the fused optimizer reads.
* Nothing that waits for the host: non-fused optimizers decide skips on the host, so they keep the eager update.

A capture that fails leaves the update eager for the rest of the run, with one warning (the summary says so).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from kiln.core.cuda_graphs import capture
from kiln.core.errors import TrainingError
from kiln.core.text import first_line

log = logging.getLogger("kiln.train")
# Eager steps before the capture: the optimizer creates its state in the first, DDP rebuilds its buckets in the second
WARMUP_STEPS = 3
# Steps in a row whose gradients do not fit the graph (another set of parameters got gradients) before it is captured
# anew, and captures after which the update stays eager
MISSES_BEFORE_RECAPTURE = 3
MAX_CAPTURES = 3
# Captures that raised before the update stays eager: a capture can fail for a passing reason (the caching allocator
# out of memory while another process fills the GPU must not free blocks mid-capture), so the first failure is tried
# again after WARMUP_STEPS more eager steps; an update that cannot be captured fails the same way twice
FAILED_CAPTURES = 2


def wanted(setting: str, device: torch.device, skips_on_device: bool, processes: int = 1) -> bool:
    """Does this run capture its update? ``auto``: one process on CUDA with an update that never waits for the host
    (a fused optimizer). Under DDP only with ``on``: that has not run on several GPUs here yet (see the README).
    ``on`` where it cannot work is an error: the setting cannot be honoured."""
    possible = device.type == "cuda" and skips_on_device
    if setting == "on" and not possible:
        why = (
            "a CUDA device: the update is captured as a CUDA graph"
            if device.type != "cuda"
            else "a fused optimizer (train.fused: true or null): a non-fused one decides on the host whether to step"
        )
        raise TrainingError(
            f"train.update_graph: on needs {why}",
            hint="set train.update_graph: auto (captured where possible) or off",
        )
    return possible and (setting == "on" or (setting == "auto" and processes == 1))


class GraphedUpdate:
    """Runs ``update(loss) -> values`` eagerly for the first steps, then as a replayed CUDA graph.

    ``update`` must do everything on the device and return a tensor that the same code rewrites in place each step
    (the step check's ``[loss, norm]``). ``kept_grads``: the loop keeps ``.grad`` allocated and zeroes it in place
    (torch.compile with CUDA graphs does), so the graph reads the gradients where they are. Otherwise the gradients
    are new tensors every step (``zero_grad(set_to_none=True)``, autograd hands its result over without a copy) and
    are copied into buffers the graph reads: one multi-tensor copy per step (its host cost is one call; keeping
    ``.grad`` allocated instead makes autograd add each parameter's gradient into it, one kernel launch per
    parameter, milliseconds of host time in a large model's backward pass)."""

    def __init__(
        self,
        update: Callable[[torch.Tensor], torch.Tensor],
        opt: torch.optim.Optimizer,
        params: list[torch.nn.Parameter],
        device: torch.device,
        kept_grads: bool,
        on_failure: Callable[[], None],
    ) -> None:
        self.update, self.opt, self.params, self.device, self.kept = update, opt, params, device, kept_grads
        self.on_failure = on_failure  # puts back host state a failed capture left half-way (GradScaler's)
        self.steps = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.values: torch.Tensor | None = None
        self.loss: torch.Tensor | None = None
        self.lrs: list[torch.Tensor] = []
        self.captured: list[torch.Tensor | None] = []  # the .grad tensors the graph reads, None where none was
        self.without: list[bool] = []  # which parameters had no gradient then (what _fits compares each step)
        self.inputs: list[torch.Tensor] = []  # of those, the ones copied into (not kept_grads)
        self.misses = 0  # steps in a row whose gradients did not fit the graph
        self.captures = 0
        self.captured_at: int | None = None
        self.eager_steps = 0  # steps after the capture that ran eagerly (gradients that did not fit)
        self.failed = 0  # captures that raised
        self.retry_at = WARMUP_STEPS  # the step after which the next capture is tried
        self.failure: str | None = None

    def __call__(self, loss: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        grads = [p.grad for p in self.params]
        if self.graph is not None and not self._fits(grads):
            self.misses += 1
            if self.misses < MISSES_BEFORE_RECAPTURE:
                self.eager_steps += 1
                return self.update(loss)
            log.info("the gradients no longer fit the update's CUDA graph (step %d): capturing it again", self.steps)
            self.graph = None
        self.misses = 0
        if self.graph is None and (
            self.steps <= self.retry_at or self.failure is not None or not self._capture(loss, grads)
        ):
            return self.update(loss)
        assert self.graph is not None and self.loss is not None and self.values is not None
        self.loss.copy_(loss)
        if not self.kept:
            torch._foreach_copy_(self.inputs, [g for g in grads if g is not None])
        for lr, group in zip(self.lrs, self.opt.param_groups):
            lr.fill_(group["lr"])
        self.graph.replay()
        if not self.kept:
            for p in self.params:  # what zero_grad(set_to_none=True) does, without its bookkeeping
                p.grad = None
        return self.values

    def summary(self) -> dict[str, Any]:
        """For the training summary: whether the update ran as a graph, from which step, or why not."""
        return {
            "captured": self.captured_at is not None and self.failure is None,
            "from_step": self.captured_at,
            "captures": self.captures,
            "eager_steps_after_capture": self.eager_steps,
            "failure": self.failure,
        }

    def _fits(self, grads: list[torch.Tensor | None]) -> bool:
        """Kept gradients: the very tensors captured. Otherwise: gradients for the same parameters (a parameter the
        forward pass did not use this step has none, and the eager update leaves it alone)."""
        if self.kept:
            return all(a is b for a, b in zip(grads, self.captured, strict=True))
        return [g is None for g in grads] == self.without

    def _capture(self, loss: torch.Tensor, grads: list[torch.Tensor | None]) -> bool:
        """Record the update (nothing runs); this step's update is the first replay. False if that failed."""
        if self.captures >= MAX_CAPTURES:
            return self._give_up(f"the gradients did not fit the captured update {self.captures} times")
        own = grads
        if not self.kept:  # the graph's own gradient buffers, filled with this step's before the first replay
            self.inputs = [torch.empty_like(g) for g in grads if g is not None]
            buffers = iter(self.inputs)
            grads = [None if g is None else next(buffers) for g in grads]
            for p, g in zip(self.params, grads):
                p.grad = g
        self.loss = torch.empty_like(loss)
        self.lrs = [torch.tensor(float(g["lr"]), device=self.device) for g in self.opt.param_groups]  # FP32
        kept = [(g["lr"], g.get("capturable")) for g in self.opt.param_groups]
        for group, lr in zip(self.opt.param_groups, self.lrs):
            group["lr"] = lr
            if "capturable" in group:  # AdamW's; SGD has none (and does not check)
                group["capturable"] = True
        try:
            self.graph, self.values = capture(lambda: self.update(self.loss), self.device, warmups=0)
        except RuntimeError as exc:  # e.g. an op that synchronises with the host
            self.on_failure()
            for p, g in zip(self.params, own):  # this step's own gradients back, for its eager update
                p.grad = g
            return self._failed(first_line(exc))
        finally:
            for group, (lr, capturable) in zip(self.opt.param_groups, kept):
                group["lr"] = lr
                if capturable is not None:
                    group["capturable"] = capturable
        self.captures += 1
        self.captured, self.without = grads, [g is None for g in grads]
        self.captured_at = self.captured_at or self.steps
        return True

    def _failed(self, reason: str) -> bool:
        """A capture raised: tried again after a few eager steps, the last time given up."""
        self.failed += 1
        if self.failed >= FAILED_CAPTURES:
            return self._give_up(reason)
        self.retry_at = self.steps + WARMUP_STEPS
        log.info(
            "capturing the update failed at step %d (tried again after step %d): %s", self.steps, self.retry_at, reason
        )
        return False

    def _give_up(self, reason: str) -> bool:
        self.graph, self.failure = None, reason
        log.warning(
            "the update after the backward pass runs without a CUDA graph (slower on the host, same result): %s", reason
        )
        return False
