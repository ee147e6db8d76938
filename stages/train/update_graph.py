"""The update after the backward pass as one CUDA graph (``train.update_graph``).

After the backward pass a step unscales the gradients (fp16), takes their norm and clips them, checks the loss and
norm (:class:`kiln.stages.train.health.StepCheck`), runs the fused optimizer (which skips a non-finite step on the
device), updates the loss scale and zeroes the gradients: about a dozen multi-tensor kernels, but several
milliseconds of Python and launch time on the host for a model with a few hundred parameter tensors (BERT-base: 3.5-4.2
ms in a bare loop on the H200's host, ``benchmarks/results/step_host_cost_h200_s12_bert_base.md``). A compiled
training step is close to host-bound, so that time is step time. Nothing in the update needs the host (the skip
decisions are on the device), so it can be captured once with ``torch.cuda.graph`` and replayed: the pattern of
PyTorch's CUDA-graphs notes for the optimizer step ("partial-network capture", ``capturable=True``), here around the
whole update, GradScaler included (fused optimizers take its ``found_inf`` in the kernel, so its step never syncs).

What a replay needs, and how it is kept:

* The same tensors every step. Gradients stay allocated and are zeroed in place (autograd then adds into them), the
  loss is copied into a buffer, and the optimizer state, GradScaler's scale and the buffer guard's copies are
  updated in place by their own code. The first steps run eagerly (``WARMUP_STEPS``): the optimizer creates its
  state and DDP rebuilds its gradient buckets (which re-points ``.grad``) in them. Should ``.grad`` ever be a
  different tensor at a later step (something set it to None), the update is captured again.
* The learning rate as a tensor: a Python float would be baked into the graph. The schedule keeps setting floats in
  the param groups; before each replay they are written into one device tensor per group (a fill kernel, no sync),
  which the captured optimizer reads (fused AdamW/SGD take a tensor ``lr``). ``capturable`` is set only while
  capturing: the fused kernels ignore it, and torch warns about it in eager steps.
* Nothing that waits for the host: non-fused optimizers decide skips on the host, so they keep the eager update.

A capture that fails leaves the update eager for the rest of the run, with one warning (``result.update_graph``
says so): capturing only records kernels, so the failed step is then run eagerly from where it stood.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from kiln.core.cuda_graphs import capture
from kiln.core.errors import TrainingError
from kiln.core.text import first_line

log = logging.getLogger("kiln.train")
# Eager steps before the capture: the optimizer creates its state in the first, DDP rebuilds its buckets in the second
WARMUP_STEPS = 3
# Captures after which a run whose gradients keep changing identity stays eager
MAX_CAPTURES = 3


def wanted(setting: str, device: torch.device, skips_on_device: bool, processes: int = 1) -> bool:
    """Does this run capture its update? ``auto``: one process on CUDA with an update that never waits for the host
    (a fused optimizer). Under DDP only with ``on``: that has not run on several GPUs here yet (see the README).
    ``on`` where it cannot work is an error: the setting cannot be honoured."""
    possible = device.type == "cuda" and skips_on_device
    if setting == "on" and not possible:
        why = "a CUDA device" if device.type != "cuda" else "a fused optimizer (train.fused: true or null)"
        raise TrainingError(f"train.update_graph: on needs {why}: the update is captured as a CUDA graph, and a "
                            "non-fused optimizer decides on the host whether to step",
                            hint="set train.update_graph: auto (captured where possible) or off")
    return possible and (setting == "on" or (setting == "auto" and processes == 1))


class GraphedUpdate:
    """Runs ``update(loss) -> values`` eagerly for the first steps, then as a replayed CUDA graph.

    ``update`` must do everything on the device and return a tensor that the same code rewrites in place each step
    (the step check's ``[loss, norm]``); ``grads`` is what gives the current gradient tensors."""

    def __init__(self, update: Callable[[torch.Tensor], torch.Tensor], opt: torch.optim.Optimizer,
                 grads: Callable[[], list[torch.Tensor | None]], device: torch.device,
                 on_failure: Callable[[], None]) -> None:
        self.update, self.opt, self.grads, self.device = update, opt, grads, device
        self.on_failure = on_failure  # puts back host state a failed capture left half-way (GradScaler's)
        self.steps = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.values: torch.Tensor | None = None
        self.loss: torch.Tensor | None = None
        self.lrs: list[torch.Tensor] = []
        self.captured_grads: list[torch.Tensor | None] = []
        self.captures = 0
        self.captured_at: int | None = None
        self.failure: str | None = None

    def __call__(self, loss: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        if self.graph is not None and not self._same_grads():
            log.info("the gradient tensors changed at step %d: capturing the update again", self.steps)
            self.graph = None
        if self.graph is None:
            if self.steps <= WARMUP_STEPS or self.failure is not None or not self._capture(loss):
                return self.update(loss)
        assert self.graph is not None and self.loss is not None and self.values is not None
        self.loss.copy_(loss)
        for lr, group in zip(self.lrs, self.opt.param_groups):
            lr.fill_(group["lr"])
        self.graph.replay()
        return self.values

    def summary(self) -> dict[str, Any]:
        """For the training summary: whether the update ran as a graph, from which step, or why not."""
        return {"captured": self.captured_at is not None and self.failure is None, "from_step": self.captured_at,
                "captures": self.captures, "failure": self.failure}

    def _same_grads(self) -> bool:
        return all(a is b for a, b in zip(self.grads(), self.captured_grads, strict=True))

    def _capture(self, loss: torch.Tensor) -> bool:
        """Record the update (nothing runs); this step's update is the first replay. False if that failed."""
        if self.captures >= MAX_CAPTURES:
            return self._give_up(f"the gradient tensors changed after {self.captures} captures")
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
            return self._give_up(first_line(exc))
        finally:
            for group, (lr, capturable) in zip(self.opt.param_groups, kept):
                group["lr"] = lr
                if capturable is not None:
                    group["capturable"] = capturable
        self.captures += 1
        self.captured_grads = list(self.grads())
        self.captured_at = self.captured_at or self.steps
        return True

    def _give_up(self, reason: str) -> bool:
        self.graph, self.failure = None, reason
        log.warning("the update after the backward pass runs without a CUDA graph (slower on the host, same "
                    "result): %s", reason)
        return False
