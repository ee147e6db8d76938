"""The training loop: autocast, scaled backward, unscale, clip, step, update — in that order.

One plain loop in the style of nanoGPT. fp16 uses a GradScaler; bf16 and fp32 run with it disabled.
Parameters stay FP32 (master weights) and the loss is computed in FP32 on FP32 logits. Each global batch
is split into ``grad_accum_steps`` micro-batches whose losses are weighted by their share of the batch,
so accumulation gives the same update as one big batch, the short last batch included. Under DDP,
gradients are all-reduced only on the last micro-step (``no_sync`` on the others): syncing on every
micro-step would move the same bytes K times for the same result. With ``train.compile`` the forward
runs through ``torch.compile`` (:mod:`kiln.stages.train.compile`); everything around it stays eager.

Nothing in a step waits for the GPU: non-finite steps are skipped on the device, and the loss and
gradient norm reach the host one step late (:mod:`kiln.stages.train.health`). The loop drains them before
a checkpoint or the epoch metrics, so a checkpoint is only written once every step before it is known.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import ExitStack, closing, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kiln.core.data import DatasetSplits, Inputs, call, rebuild, rows, take, tensors
from kiln.core.errors import InputFileError, TrainingError
from kiln.core.outputs import flatten_outputs
from kiln.core.progress import Progress, SilentProgress
from kiln.core.text import fmt
from kiln.core.threads import follow_load
from kiln.core.user_errors import running_user_code
from kiln.models.model_io import load_weights
from kiln.stages.train import checkpoint as ckpt
from kiln.stages.train import update_graph
from kiln.stages.train.compile import CompiledModel, unpaid_warning
from kiln.stages.train.config import TrainConfig
from kiln.stages.train.data import local_batch_size, make_loader, micro_batches
from kiln.stages.train.dist import DistEnv, all_sum, env_from_torchrun, unused_parameters_error, wrap_ddp
from kiln.stages.train.health import (
    BufferGuard,
    LaggedStats,
    StepCheck,
    StepStats,
    skip_if_nonfinite,
    skips_on_device,
)
from kiln.stages.train.metrics import (
    EpochMetrics,
    TrainResult,
    peak_memory_mb,
    plot_loss,
    reset_peak_memory,
)
from kiln.stages.train.optim import (
    make_optimizer,
    make_schedule,
    replay_schedule,
    zero_momentum_buffers,
)
from kiln.stages.train.precision import (
    autocast,
    fp32_norms,
    make_scaler,
    resolve_device,
    resolve_precision,
    update_scaler,
)
from kiln.stages.train.runtime import determinism, profiler
from kiln.stages.train.task import (
    Task,
    bce_autocast_fix,
    check_loss_has_grad,
    check_trainable,
    loss_errors,
)

log = logging.getLogger("kiln.train")
# Skipped steps of one NaN/Inf streak said as warnings; the rest go to the debug log (-v) until the streak ends
SAID_STREAK = 3
StepHook = Callable[[int], None]
# How many steps the host may queue ahead of the loss/norm values it has read (health.py): deep enough to absorb
# host jitter, short enough that a NaN abort comes promptly. Each queued step holds 8 bytes of pinned memory.
MAX_LAG = 8
# What an abort names as the last good checkpoint before any is written
NO_CHECKPOINT = "none written yet"
# The schedule counts batches, stepped or skipped (and a resume replays it without optimizer steps);
# torch warns when a scheduler steps before the optimizer has.
SCHED_WARNING = r"Detected call of `lr_scheduler.step\(\)` before"


@torch.no_grad()
def evaluate_loss_acc(
    model: nn.Module,
    x: Inputs,
    y: torch.Tensor,
    device: torch.device,
    env: DistEnv = DistEnv(),
    batch: int = 256,
    task: Task | None = None,
    forward: Callable[..., Any] | None = None,
) -> tuple[float, float | None]:
    """FP32 validation loss and accuracy (None without class labels); each process takes every W-th sample,
    then one all-reduce. ``batch``: the rows of one call, no more than the model takes (the training loop passes
    its micro-batch). ``forward``: what runs ``model`` (its compiled version), by default ``model`` itself.
    ``task``: the loss; None is cross-entropy over class labels, a Task of this call's own (a Task records what it
    has checked during a run, so none is shared between calls)."""
    task = task if task is not None else Task("classification")
    was_training = model.training
    model.eval()
    run = forward or model
    x, y = take(x, slice(env.rank, None, env.world_size)), y[env.rank :: env.world_size]
    correct: float | None = 0.0
    loss_sum, units, scored = 0.0, 0.0, 0.0
    for i in range(0, len(y), batch):
        xb = take(x, slice(i, i + batch))
        out = call(run, rebuild(xb, [t.to(device) for t in tensors(xb)]))
        target = y[i : i + batch].to(device)
        n = float(task.units(target))  # what the loss averages over: rows, or labelled positions
        with loss_errors(task, "computing the validation loss"):
            loss_sum += task.loss(out, target).item() * n  # the mean loss, weighted by what it averages over
        units += n
        counted = task.correct(out, target)  # (hits, labelled rows or positions): accuracy's own count
        correct = None if counted is None or correct is None else correct + counted[0]
        scored += counted[1] if counted is not None else 0.0
    sums = all_sum([correct or 0.0, loss_sum, units, scored], device, env)
    model.train(was_training)
    return sums[1] / max(1.0, sums[2]), (None if correct is None else sums[0] / max(1.0, sums[3]))


def _finite_rows(
    model: nn.Module, x: Inputs, device: torch.device, env: DistEnv, batch: int, forward: Callable[..., Any] | None
) -> Iterator[torch.Tensor]:
    """Per batch of this process's share of ``x`` (as :func:`evaluate_loss_acc` takes it), whether ``model`` (run by
    ``forward``, in eval mode) answers each row with finite values in every float output; an output not laid out by
    row (of another length) counts for the whole batch. The model's mode is restored when the iteration ends."""
    was_training = model.training
    model.eval()
    x = take(x, slice(env.rank, None, env.world_size))
    try:
        with torch.no_grad():
            for i in range(0, rows(x), batch):
                xb = take(x, slice(i, i + batch))
                out = flatten_outputs(call(forward or model, rebuild(xb, [t.to(device) for t in tensors(xb)])))
                n = rows(xb)
                finite = torch.ones(n, dtype=torch.bool, device=device)
                for t in (t for t in out.values() if t.is_floating_point()):
                    by_row = t.dim() > 0 and len(t) == n
                    finite &= torch.isfinite(t.reshape(n, -1)).all(dim=1) if by_row else bool(torch.isfinite(t).all())
                yield finite
    finally:
        model.train(was_training)


def outputs_finite(
    model: nn.Module,
    x: Inputs,
    device: torch.device,
    env: DistEnv = DistEnv(),
    batch: int = 256,
    forward: Callable[..., Any] | None = None,
) -> bool:
    """Whether ``model`` (run by ``forward``) answers this process's share of the held-out inputs ``x`` with finite
    outputs only (:func:`_finite_rows`; no collective): tells a NaN of the model from one of the loss."""
    with closing(_finite_rows(model, x, device, env, batch, forward)) as batches:
        return all(bool(finite.all()) for finite in batches)


def nonfinite_rows(
    model: nn.Module,
    x: Inputs,
    device: torch.device,
    env: DistEnv = DistEnv(),
    batch: int = 256,
    forward: Callable[..., Any] | None = None,
) -> tuple[int, int]:
    """How many held-out rows of ``x`` ``model`` (run by ``forward``, in eval mode) answers with NaN or infinity in
    some float output (:func:`_finite_rows`), and of how many rows, over all processes (one all-reduce). Tells weights
    that give no finite answer at all (a blown-up update) from a forward that makes NaN on a few rows (a fully masked
    one)."""
    bad = total = 0
    for finite in _finite_rows(model, x, device, env, batch, forward):
        bad, total = bad + len(finite) - int(finite.sum()), total + len(finite)
    bad_all, total_all = all_sum([float(bad), float(total)], device, env)
    return int(bad_all), int(total_all)


def mostly_nonfinite(counted: tuple[int, int]) -> bool:
    """Whether more than half of the counted rows (:func:`nonfinite_rows`) got NaN/Inf outputs: weights, not a few
    odd rows, make them."""
    bad, total = counted
    return total > 0 and 2 * bad > total


FORWARD_NAN = (
    "the model's outputs are already NaN or infinite on the first training batch, before any update: its forward "
    "makes them, not training"
)
FORWARD_NAN_FIX = (
    "find where forward makes NaN: a softmax over a row whose scores are all -inf (a padded query whose keys are all "
    "masked) is NaN; keep one key unmasked per row (the row's own position, or a virtual token), or fill masked "
    "scores with a large negative number (torch.finfo(scores.dtype).min) instead of -inf"
)


def user_loss_nan(loss: str) -> str:
    """Why a loss is not finite where the model's outputs are: train.loss (named ``loss``) makes the NaN."""
    return f"the model's outputs are finite: train.loss {loss} returns NaN or infinity for them"


def first_batch_nonfinite(
    model: nn.Module, x: Inputs, device: torch.device, batch: int, forward: Callable[..., Any] | None = None
) -> bool:
    """Whether ``model`` answers the first ``batch`` training rows ``x`` with NaN or infinity (:func:`outputs_finite`):
    at weights no step has updated, the forward itself makes them, which no learning rate or precision fixes."""
    return not outputs_finite(model, take(x, slice(0, batch)), device, batch=batch, forward=forward)


def evaluate(model: nn.Module, x: Inputs, y: torch.Tensor, device: torch.device, batch: int = 256) -> float | None:
    return evaluate_loss_acc(model, x, y, device, batch=batch)[1]


def grad_norm(params: list[nn.Parameter], clip: float | None) -> torch.Tensor:
    """Global gradient norm (clipping to ``clip`` if set). Under DDP the gradients are already all-reduced,
    so every process gets the same norm and takes the same skip decision without another collective."""
    if clip is not None:
        return nn.utils.clip_grad_norm_(params, clip)
    return nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])


def train(
    model: nn.Module,
    data: DatasetSplits,
    cfg: TrainConfig,
    seed: int = 0,
    progress: Progress | None = None,
    *,
    env: DistEnv | None = None,
    ckpt_dir: Path | None = None,
    run_key: str = "",
    out_dir: Path | None = None,
    on_step: StepHook | None = None,
    task: Task | None = None,
    sources: dict[str, Any] | None = None,
) -> TrainResult:
    """Train ``model`` in place (returned on CPU, eval mode). Only the main process writes files:
    checkpoints into ``ckpt_dir``, ``loss.png``/``trace.json`` into ``out_dir``. ``sources``: the code and data
    the run trains from (:func:`kiln.stages.train.checkpoint.changed_sources`), recorded with its checkpoints; an
    interrupted run resumes only from the same (None: not compared). ``task``: the loss (None: cross-entropy over
    class labels, see :func:`evaluate_loss_acc`)."""
    env = env or env_from_torchrun()
    device = resolve_device(cfg, env.local_rank if env.enabled else None)
    precision = resolve_precision(cfg, device)
    with ExitStack() as stack:
        stack.enter_context(determinism(cfg.deterministic, device))
        torch.manual_seed(seed)
        model.to(device).train()
        norms = stack.enter_context(fp32_norms(model, device, precision, cfg.amp.fp32_norms))
        outputs = ckpt.outputs_folder(out_dir)
        trainer = _Trainer(
            model, data, cfg, seed, env, device, precision, ckpt_dir, run_key, on_step, task, sources, outputs
        )
        trainer.result.fp32_norms = norms
        prof = stack.enter_context(profiler(cfg.profile_steps, device, out_dir if env.is_main else None))
        trainer.run(progress or SilentProgress(), prof)
    result = trainer.result
    if env.is_main and out_dir is not None and cfg.plot and result.history:
        plot_loss(result.history, out_dir / "loss.png", f"{type(model).__name__} ({precision})")
        result.files.append("loss.png")
    if out_dir is not None and cfg.profile_steps and (out_dir / "trace.json").is_file():
        result.files.append("trace.json")
    model.to("cpu").eval()
    return result


def _compile_note(c: dict[str, Any]) -> str:
    """One log line: what torch.compile did in this run."""
    state = f"fell back to eager ({c['fallback']})" if c["fallback"] else f"mode {c['mode']}"
    note = (
        f"{state}; {c['graphs']} graphs, {c['recompiles']} recompiles, {c['graph_breaks']} graph breaks, "
        f"{c['compile_s']:.1f} s compiling, {c.get('eager_calls', 0)} calls of other shapes run eagerly"
    )
    reasons = c["recompile_reasons"] + c["graph_break_reasons"]
    return note + (" (" + "; ".join(reasons[:3]) + ")" if reasons else "")


# torch's BatchNorm on a batch of one row in training mode: no variance to normalise by
ONE_ROW_BATCHNORM = "Expected more than 1 value per channel when training"


def one_row_hint(exc: BaseException) -> str | None:
    """For BatchNorm refusing a batch of one row: the row is the epoch's last batch on a process (the loader warned
    which train.batch_size avoids it), not a fault of the model's forward; None for any other error."""
    if ONE_ROW_BATCHNORM not in str(exc):
        return None
    return (
        "a batch of one row reached BatchNorm, which cannot train on one row: it is the epoch's last batch on a "
        "process (the warning before names a train.batch_size that leaves none); change train.batch_size"
    )


class _Trainer:
    """State of one run. A class only so the step and the epoch can be short methods sharing it."""

    def __init__(
        self,
        model: nn.Module,
        data: DatasetSplits,
        cfg: TrainConfig,
        seed: int,
        env: DistEnv,
        device: torch.device,
        precision: str,
        ckpt_dir: Path | None,
        run_key: str,
        on_step: StepHook | None,
        task: Task | None = None,
        sources: dict[str, Any] | None = None,
        outputs: Path | None = None,
    ) -> None:
        self.model, self.data, self.cfg, self.env, self.device = model, data, cfg, env, device
        self.precision, self.ckpt_dir, self.run_key, self.on_step = precision, ckpt_dir, run_key, on_step
        self.sources = sources
        self.loader, self.sampler = make_loader(data.train_x, data.train_y, cfg, env, seed, device)
        self.local_batch = local_batch_size(cfg, env)
        self.steps_per_epoch = math.ceil(self.sampler.num_samples / self.local_batch)
        check_trainable(model)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = make_optimizer(model, cfg, device)
        self.total_steps = self.steps_per_epoch * cfg.epochs
        self.sched = make_schedule(self.opt, cfg, self.total_steps)
        self.scaler = make_scaler(cfg.amp, device, precision)
        # The update skips non-finite steps on the device (GradScaler for fp16, found_inf for fused
        # optimizers), so the host may look at a step's values late. Otherwise it decides at once.
        self.device_skip = self.scaler.is_enabled() or skips_on_device(self.opt)
        self.stats = LaggedStats(device, lag=1, max_lag=MAX_LAG) if self.device_skip else LaggedStats(device, lag=0)
        # the loss: cross-entropy, MSE or the user's (kiln.stages.train.task); None: cross-entropy, a Task of this
        # run's own, since a Task records what it has checked during a run
        self.task = task if task is not None else Task("classification")
        self.result = TrainResult(
            precision=precision,
            device=str(device),
            world_size=env.world_size,
            checkpoint_dir=str(ckpt_dir) if ckpt_dir else None,
        )
        self.epoch, self.step_in_epoch, self.last_good = 0, 0, NO_CHECKPOINT
        self.bad_streak = 0  # consecutive steps with a NaN/Inf loss (fp16 scale back-offs do not count)
        self.updates = 0  # optimizer steps of this process's run that updated the weights
        self.best_digest: str | None = None  # sha256 of best.safetensors, kept in last.pt to find it on resume
        self.best_tie_loss: float | None = None  # the best epoch's validation loss: breaks validation accuracy ties
        self.acc: dict[str, float] = {}  # running sums of the current epoch (this process's share)
        self.settings = cfg.model_dump(mode="json")  # recorded in last.json (checkpoint.run_info)
        self.finished = False  # a finished run taken whole: nothing to train (checkpoint.find_resume)
        self.outputs = outputs  # the stage folder the outputs go to (checkpoint.outputs_written)
        self.first_bad_step: int | None = None  # this run's first step with a non-finite loss or gradients
        # (bad rows, rows, updates) of the last validation whose loss was not finite: weights no update changed
        # since (self.updates the same) still give those outputs
        self.nan_outputs: tuple[int, int, int] | None = None
        self._maybe_resume()
        self.ddp = wrap_ddp(model, env, cfg.distributed, device)  # after loading: DDP broadcasts rank 0's weights
        # What the steps call: torch.compile of the DDP module (DDP first: see compile.py), or the module itself.
        # self.model stays the plain module, so state dicts never carry torch.compile's "_orig_mod." prefix.
        self.net = CompiledModel(self.ddp, cfg.compile_options, device)
        micro = -(-self.local_batch // cfg.grad_accum_steps)
        if cfg.grad_accum_steps > self.local_batch:  # exact still: micro-batches of one sample, one step each
            log.warning(
                "train.grad_accum_steps %d is more than the %d samples of each process's batch: micro-batches of one "
                "sample, %d steps each; lower it to at most %d",
                cfg.grad_accum_steps,
                self.local_batch,
                self.local_batch,
                self.local_batch,
            )
        # Evaluation in batches of one micro-batch: a size the model takes (a graph given as a batch of one takes
        # one a call, train.batch_size: 1), and with static graphs a shape the compiled module serves
        self.eval_batch = micro
        # The update after the backward pass as one CUDA graph (update_graph.py), where it never waits for the host
        graphed = update_graph.wanted(cfg.update_graph, device, skips_on_device(self.opt), env.world_size)
        # torch.compile's CUDA graphs: .grad stays allocated and is zeroed in place, autograd adds into it (compile.py)
        self.keep_grads = self.net.keeps_grads
        if self.keep_grads:
            for p in self.params:
                p.grad = torch.zeros_like(p)
        self.guard = BufferGuard(model)  # after wrap_ddp: SyncBatchNorm takes over the same buffer tensors
        self.check = StepCheck(device, self.guard, graph=not graphed)  # not a graph of its own inside the update's
        self.update: Callable[[torch.Tensor], torch.Tensor] = self._update_on_device
        if graphed:
            self.update = update_graph.GraphedUpdate(
                self._update_on_device,
                self.opt,
                self.params,
                device,
                self.keep_grads,
                on_failure=self._reset_scaler_state,
            )

    # -- resume / checkpoint ------------------------------------------------------------------------
    def _maybe_resume(self) -> None:
        if self.ckpt_dir is None and self.cfg.checkpoint.resume in ("auto", "never"):
            return
        resume, folder = self.cfg.checkpoint.resume, self.ckpt_dir or Path(".")
        path = ckpt.find_resume(resume, folder, self.run_key, self.sources, self.settings, self.outputs)
        if path is None:
            return
        state = ckpt.load_state(path)
        if state.get("run_key") != self.run_key:
            log.warning(
                "resuming from %s, written by another training configuration (run key %s, now %s)",
                path,
                state.get("run_key"),
                self.run_key,
            )
        try:
            self._restore(state, path)
        except (RuntimeError, ValueError, KeyError, TypeError) as exc:  # another model, optimizer or format
            raise InputFileError(
                f"cannot resume from {path}: it does not fit this run ({type(exc).__name__}: "
                f"{' '.join(str(exc).split())[:300]})",
                hint="resume only with the model and train.optimizer that wrote it, or set "
                "train.checkpoint.resume: never",
            ) from None
        self.result.resumed_from, self.last_good = str(path), f"{path} (step {state['global_step']})"
        # auto found this run's own finished last.pt (checkpoint.notes_only_changed): taken as it is. An explicit
        # resume path of a finished run is resumed like any other, and its state saved into this run's folder.
        if resume == "auto" and state.get("complete") and self.epoch >= self.cfg.epochs:
            self.finished = True
            log.info(
                "took the finished run in %s (%s): not trained again", path, ckpt.taken_because(folder, self.settings)
            )
            return
        log.info("resumed from %s at epoch %d, step %d", path, self.epoch + 1, state["global_step"])

    def _restore(self, state: dict[str, Any], path: Path) -> None:
        self.model.load_state_dict(ckpt.plain_keys(state["model"]))
        self.opt.load_state_dict(state["optimizer"])  # moments and step counts; its lr etc. are replaced below
        zero_momentum_buffers(self.opt)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=SCHED_WARNING)
            # The LR follows this config at the resumed step (not the old run's lr and length): the
            # abort's advice "lower train.lr and resume" must take effect. state["scheduler"] is not read.
            self.sched = replay_schedule(self.opt, self.cfg, self.total_steps, state["global_step"])
        self.scaler.load_state_dict(state["scaler"])
        ckpt.set_rng_state(state["rng"])
        self.epoch, self.step_in_epoch = state["epoch"], state["step_in_epoch"]
        # The saved sums are over all processes (see _save): one process takes them, the others start at 0.
        self.acc = {k: v if self.env.is_main else 0.0 for k, v in state["acc"].items()}
        self.result.history = [EpochMetrics(**m) for m in state["history"]]
        self.result.global_step, self.result.best_epoch = state["global_step"], state["best_epoch"]
        self.result.best_val_accuracy = state["best_val_accuracy"]
        self.result.best_val_loss, self.result.best_by = state.get("best_val_loss"), state.get("best_by")
        self.best_digest = state.get("best_sha256")
        self._adopt_best(path)

    def _adopt_best(self, path: Path) -> None:
        """Bring the resumed run's best.safetensors into this run's checkpoint folder. It lies beside the
        last.pt resumed from (another folder when that was another run key); it is accepted only when its
        digest is the one last.pt recorded, so a stale best of some other run is never taken."""
        if self.result.best_epoch is None:
            return
        found = ckpt.find_best([self.ckpt_dir, path.parent], self.best_digest, path.parent)
        if found is not None:
            if self.ckpt_dir is not None and self.env.is_main and found != self.ckpt_dir / ckpt.BEST:
                ckpt.copy_file(found, self.ckpt_dir / ckpt.BEST)
            return
        if self.cfg.checkpoint.select == "best":  # with select: last the best weights are never loaded
            log.warning(
                "the best weights of the resumed run (epoch %s) are not in %s; select: best now chooses "
                "among the epochs trained from here on",
                self.result.best_epoch,
                path.parent / ckpt.BEST,
            )
        self.result.best_epoch = self.result.best_val_accuracy = self.best_digest = None
        self.result.best_val_loss = self.result.best_by = None

    def _save(self, complete: bool = False) -> None:
        if self.ckpt_dir is None:
            return
        acc = self._global_acc()  # a collective: every process reaches _save at the same steps
        if not self.env.is_main:
            return
        # A skipped step leaves weights and buffers as they were, so the state is normally good even
        # right after a NaN step or an fp16 back-off; this catches weights that became NaN/Inf anyway.
        # Parameters and optimizer state only: buffers may hold inf on purpose (a -inf causal mask), and the
        # buffer guard already undoes what a skipped step wrote into them.
        if not ckpt.all_finite(dict(self.model.named_parameters()), self.opt.state_dict()["state"]):
            log.warning(
                "no checkpoint at step %d: the weights or optimizer state hold NaN/Inf", self.result.global_step
            )
            return
        if self._weights_give_nan():
            bad, total, _ = self.nan_outputs  # type: ignore[misc]
            log.warning(
                "no checkpoint at step %d: the weights give NaN/Inf outputs on %d of the %d held-out rows",
                self.result.global_step,
                bad,
                total,
            )
            return
        r = self.result
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.opt.state_dict(),
            "scheduler": self.sched.state_dict(),
            "scaler": self.scaler.state_dict(),
            "rng": ckpt.rng_state(),
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "global_step": r.global_step,
            "acc": acc,
            "history": [vars(m) for m in r.history],
            "best_epoch": r.best_epoch,
            "best_val_accuracy": r.best_val_accuracy,
            "best_val_loss": r.best_val_loss,
            "best_by": r.best_by,
            "best_sha256": self.best_digest,
            "run_key": self.run_key,
            "complete": complete,
        }
        ckpt.save_state(self.ckpt_dir / ckpt.LAST, state)
        self._save_info(complete)
        self.last_good = f"{self.ckpt_dir / ckpt.LAST} (step {r.global_step}" + (
            ")"
            if self.updates or self.result.resumed_from
            else ": the weights training started from, no step has updated them)"
        )

    def _weights_give_nan(self) -> bool:
        """Whether the last validation found NaN/Inf outputs on most held-out rows (:func:`mostly_nonfinite`) and no
        update has changed the weights since: finite weights, yet not a checkpoint to resume from or to select."""
        found = self.nan_outputs
        return found is not None and found[2] == self.updates and mostly_nonfinite(found[:2])

    def _save_info(self, complete: bool) -> None:
        """last.json beside last.pt: what a later run checks before loading it (checkpoint.find_resume)."""
        if self.ckpt_dir is None or not self.env.is_main:
            return
        state = {"epoch": self.epoch, "complete": complete, "global_step": self.result.global_step}
        state["history"] = ckpt.history_digest([vars(m) for m in self.result.history])  # checkpoint.outputs_written
        info = ckpt.run_info(self.run_key, self.settings, **state)
        ckpt.write_info(self.ckpt_dir, info | ({"sources": self.sources} if self.sources is not None else {}))

    def _global_acc(self) -> dict[str, float]:
        """The epoch's running sums over all processes: saved from rank 0 alone they would lose the
        other processes' share of a resumed epoch's loss, sample and skip counts."""
        keys = sorted(self.acc)
        return dict(zip(keys, all_sum([self.acc[k] for k in keys], self.device, self.env))) if keys else {}

    def doing(self) -> str:
        """The step being run, for an error the user's forward or loss raises in it."""
        autocast = f" under {self.precision} autocast" if self.precision != "fp32" else ""
        return f"training step {self.result.global_step + 1} (epoch {self.epoch + 1}){autocast}"

    def step_hint(self, exc: BaseException) -> str | None:
        """A failing step's fix beyond the line it failed at: :func:`one_row_hint`, else :meth:`autocast_hint`."""
        return one_row_hint(exc) or self.autocast_hint(exc)

    def autocast_hint(self, exc: BaseException) -> str | None:
        """For a dtype clash in the user's code under autocast: the ops autocast lowers return bf16/fp16 tensors, and
        a tensor the code makes itself in float32 (``torch.zeros(...)``, ``dtype=x.dtype`` of an input) meets one."""
        text = str(exc).lower()
        if self.precision == "fp32" or not ("dtype" in text or "scalar type" in text):
            return None
        return (
            f"under {self.precision} autocast the model's outputs and some ops' results are {self.precision}: in a "
            "loss, compare outputs.float() with the targets; a tensor your code makes takes the dtype of the one it "
            "meets (torch.zeros(..., dtype=x.dtype)); or train without autocast (train.precision: fp32)"
        )

    def loss_hint(self, exc: BaseException) -> str | None:
        """For train.loss failing on a dtype clash under autocast: :meth:`autocast_hint`, or where the clash is in
        torch's binary_cross_entropy, which autocast cannot run safely, its form on logits."""
        hint = self.autocast_hint(exc)
        return hint and (bce_autocast_fix(exc) or hint)

    # -- the loop -------------------------------------------------------------------------------------
    def run(self, progress: Progress, prof: Any) -> None:
        with warnings.catch_warnings(), progress.task("training", total=self.cfg.epochs) as bar:
            warnings.filterwarnings("ignore", message=SCHED_WARNING)
            bar.advance(self.epoch)
            t0 = time.perf_counter()  # the loop's wall time, compiling included: did train.compile pay?
            while self.epoch < self.cfg.epochs:
                m = self._epoch(prof)
                note = f"loss {m.loss:.3f}" + (f" acc {m.val_accuracy:.3f}" if m.val_accuracy is not None else "")
                bar.advance(1, note=note)
            run_s = time.perf_counter() - t0
        self._say_most_skipped()
        if self.finished:  # its last.pt stays as it is; last.json records the settings it now stands for
            self._save_info(complete=True)
        else:
            self._save(complete=True)
        r = self.result
        r.compile = self.net.summary(run_s)
        if r.compile is not None:
            log.info("torch.compile: %s", _compile_note(r.compile))
            unpaid = unpaid_warning(r.compile, str(self.device))
            if unpaid and self.env.is_main:
                log.warning("%s", unpaid)
        if isinstance(self.update, update_graph.GraphedUpdate):
            r.update_graph = self.update.summary()
        r.selected_epoch = r.history[-1].epoch if r.history else None
        if self.cfg.checkpoint.select == "best" and r.best_epoch is not None and self.ckpt_dir:
            self._load_best()
            r.selected_epoch = r.best_epoch
        elif self.cfg.checkpoint.select == "best":
            log.warning("checkpoint.select: best: no epoch had a finite validation score; the last epoch's weights")
        self._refuse_diverged(self.result.selected())

    def _refuse_diverged(self, chosen: EpochMetrics | None = None) -> None:
        """Fail where the weights give NaN/Inf outputs on most held-out rows: finite weights that an update blew up
        (a learning rate too high) answer nothing, yet would pass as trained and every gate against themselves.
        ``chosen``: the returned weights' epoch, checked only where its validation loss was not finite (else the
        weights as they are now, at an abort). Counted by this process alone, on its own weights. Weights no update
        changed (the forward's NaN: :meth:`_forward_makes_nan`) or that hold NaN themselves (the checkpoint refuses
        them) are said elsewhere."""
        if chosen is not None and (chosen.val_loss is None or math.isfinite(chosen.val_loss)):
            return
        if not self.updates or not ckpt.all_finite(dict(self.model.named_parameters())):
            return
        bad, total = nonfinite_rows(self.model, self.data.val_x, self.device, DistEnv(), self.eval_batch)
        if not mostly_nonfinite((bad, total)):
            return
        at = f" at step {self.first_bad_step}" if self.first_bad_step else ""
        clip = self.cfg.grad_clip is None and self.cfg.optimizer == "sgd"
        raise TrainingError(
            f"training diverged{at}: the weights give no finite output on {bad} of the {total} held-out rows "
            f"(NaN or infinity), after {self.updates} update{'' if self.updates == 1 else 's'} (train.lr "
            f"{self.cfg.lr:g}, {self.cfg.optimizer})",
            hint="lower train.lr (e.g. 10 times)"
            + (" and set train.grad_clip (e.g. 1.0) to bound each step" if clip else "")
            + (
                f"; train.checkpoint.resume: <last.pt> continues from the last checkpoint of finite outputs, "
                f"{self.last_good}"
                if self.ckpt_dir is not None and self.last_good != NO_CHECKPOINT
                else ", and train again from the start (no checkpoint of finite outputs was written)"
            ),
        )

    def _say_most_skipped(self) -> None:
        """Warn when most of the run's steps were skipped and the run still ends (all of them: the stage's error):
        the weights then come from a few steps, whatever the last epoch's loss says."""
        planned = sum(m.steps for m in self.result.history)
        bad = sum(m.nonfinite_steps for m in self.result.history)
        overflow = sum(m.skipped_steps for m in self.result.history)
        if self.env.is_main and planned and planned / 2 < bad + overflow < planned:
            log.warning(
                "%d of the run's %d training steps were skipped (%d with a non-finite loss or gradients, %d for fp16 "
                "gradient overflow): the weights learned from %d step%s only",
                bad + overflow,
                planned,
                bad,
                overflow,
                planned - bad - overflow,
                "" if planned - bad - overflow == 1 else "s",
            )

    def _epoch(self, prof: Any) -> EpochMetrics:
        cfg, epoch = self.cfg, self.epoch
        follow_load()  # the CPU threads Kiln chose for the stage, set again for the load now (others' work varies)
        self.sampler.set_position(epoch, self.step_in_epoch * self.local_batch)
        if not self.acc:
            self.acc = {"loss": 0.0, "seen": 0.0, "samples": 0.0, "secs": 0.0, "skipped": 0.0, "nonfinite": 0.0}
        reset_peak_memory(self.device)
        self.guard.save()  # evaluation and checkpointing ran since the last step: what a skipped step goes back to
        t0 = time.perf_counter()
        for xb, yb in self.loader:
            with running_user_code(self.doing, hint=self.step_hint, model=True):  # a failure names the step
                self._step(xb, yb)
            prof.step()
            if cfg.checkpoint.every_steps and self.result.global_step % cfg.checkpoint.every_steps == 0:
                self._drain()  # the checkpoint waits until every step before it is known (and accounted)
                self._sync()
                self.acc["secs"] += time.perf_counter() - t0
                self._save()
                t0 = time.perf_counter()
            if self.on_step is not None:
                self.on_step(self.result.global_step)
        self._drain()
        self._sync()
        self.acc["secs"] += time.perf_counter() - t0
        m = self._epoch_metrics()
        self.result.history.append(m)
        log.info("epoch %d: loss %.4f, val acc %s, %.0f samples/s", m.epoch, m.loss, m.val_accuracy, m.samples_per_s)
        self.epoch, self.step_in_epoch, self.acc = epoch + 1, 0, {}
        if self.epoch < cfg.epochs:  # after the last epoch run() writes the final, complete checkpoint
            self._save()
        return m

    def _step(self, xb: Inputs, yb: torch.Tensor) -> None:
        try:
            total = self._forward_backward(xb, yb)
        except self.net.errors as exc:  # a backward graph failed to compile (forward failures: CompiledModel)
            if not self.net.compiled:
                raise
            self.net.fall_back(exc)  # raises with fullgraph: true
            self.opt.zero_grad(set_to_none=not self.keep_grads)  # the step again from scratch, eagerly
            self.guard.restore()  # the forward passes updated BatchNorm statistics
            total = self._forward_backward(xb, yb)
        except RuntimeError as exc:  # DDP's for a parameter without gradient: said as one error with its fix
            err = unused_parameters_error(exc, self.model)
            if err is None:
                raise
            raise err from None
        self.result.global_step += 1
        done: list[tuple[StepStats, float, float]] = []
        if self.device_skip:
            values = self.update(total)
            self.stats.push(self.result.global_step, self.epoch, rows(xb), values)
        else:  # a non-fused optimizer without a scaler: the host decides (lag 0: this step's values are read now)
            values, _ = self.check(total, grad_norm(self.params, self.cfg.grad_clip))
            self.stats.push(self.result.global_step, self.epoch, rows(xb), values)
            done = list(self.stats.ready())
            if all(math.isfinite(v) for _, loss_v, norm_v in done for v in (loss_v, norm_v)):
                self.opt.step()
            self.opt.zero_grad(set_to_none=not self.keep_grads)
        self.sched.step()
        self.step_in_epoch += 1
        self.acc["samples"] += rows(xb)
        # With device-side skipping these are the previous step's values; this step's work is queued
        # behind them, so the GPU stays busy while the host looks.
        self._account(done if not self.device_skip else list(self.stats.ready()))

    def _update_on_device(self, total: torch.Tensor) -> torch.Tensor:
        """Everything after the backward pass, decided on the device (what :class:`GraphedUpdate` captures): unscale,
        clip, the step check, the step (skipped when non-finite), the scale update, zeroed gradients. Returns the
        step's ``[loss, norm]`` (StepCheck's tensor, rewritten by the next step)."""
        self.scaler.unscale_(self.opt)  # clip the true gradients, not the scaled ones
        norm = grad_norm(self.params, self.cfg.grad_clip)
        # [loss, norm], the non-finite flag, and the buffers put back if it is set (StepCheck; on the device)
        values, found = self.check(total, norm)
        if self.scaler.is_enabled():
            self.scaler.step(self.opt)  # skips the update itself when gradients are inf/NaN
            update_scaler(self.scaler, self.cfg.amp)
        else:
            with skip_if_nonfinite(self.opt, found):
                self.opt.step()
        self.opt.zero_grad(set_to_none=not self.keep_grads)
        return values

    def _reset_scaler_state(self) -> None:
        """After a failed capture: GradScaler's per-optimizer stage as ``update()`` leaves it (the capture stopped
        between its unscale and its update; nothing it recorded ran), so the step can run eagerly."""
        if self.scaler.is_enabled():
            self.scaler._per_optimizer_states.clear()  # a defaultdict: the next access starts a fresh state

    def _forward_backward(self, xb: Inputs, yb: torch.Tensor) -> torch.Tensor:
        """The micro-steps of one batch: forward, FP32 loss, scaled backward. Returns the batch's loss."""
        chunks = micro_batches(xb, yb, self.cfg.grad_accum_steps)
        if self.net.static and not self.net.shapes and rows(xb) == self.local_batch:
            self.net.serve_shapes_of([cx for cx, _ in chunks])  # a full batch: the shapes worth compiling
        total: torch.Tensor | None = None
        for i, (cx, cy) in enumerate(chunks):
            last = i == len(chunks) - 1
            sync = self.ddp.no_sync() if self.env.enabled and not last else nullcontext()  # type: ignore[operator]
            with sync:
                cx = rebuild(cx, [t.to(self.device, non_blocking=True) for t in tensors(cx)])
                cy = cy.to(self.device, non_blocking=True)
                with autocast(self.device, self.precision):
                    out = call(self.net, cx)
                # FP32 loss, weighted by the micro-batch's share of the batch (of its rows, or of its labelled
                # positions): the K weighted means add up to the mean over the whole batch, also when the last
                # micro-batch is smaller.
                with loss_errors(self.task, self.doing, self.loss_hint):
                    loss = self.task.loss(out, cy)
                check_loss_has_grad(self.task, loss)
                if len(cy) != rows(xb):  # one micro-batch: weight 1, no extra kernels
                    loss = loss * self.task.share(cy, yb)
                self.scaler.scale(loss).backward()
            total = loss.detach() if total is None else total + loss.detach()
        assert total is not None
        return total

    def _drain(self) -> None:
        self._account(list(self.stats.drain()))

    def _account(self, stats: list[tuple[StepStats, float, float]]) -> None:
        """Book-keeping of finished steps; aborts when non-finite losses persist beyond the patience."""
        for s, loss_v, norm_v in stats:
            if math.isfinite(loss_v):
                self.acc["loss"] += loss_v * s.samples
                self.acc["seen"] += s.samples
            if math.isfinite(norm_v) and math.isfinite(loss_v):
                self.bad_streak, self.updates = 0, self.updates + 1
                continue
            overflow = self.scaler.is_enabled() and self._loss_finite_everywhere(loss_v, norm_v)
            if overflow and self._scale_can_back_off():
                # fp16 gradient overflow on a finite loss: the scaler skipped the step and backs off. That
                # is how dynamic loss scaling finds its scale, not a NaN/Inf loss: it ends a NaN streak
                # rather than extending it (a large init_scale takes dozens of back-offs).
                self.acc["skipped"] += 1
                self.bad_streak = 0
                log.info("step %d skipped: fp16 gradients overflowed (loss scale backs off)", s.step)
                continue
            if overflow and self.cfg.amp.loss_scale != "dynamic":
                self._fixed_scale_overflow(s)
                continue
            self.acc["nonfinite"] += 1
            self.bad_streak += 1
            self.first_bad_step = self.first_bad_step or s.step
            (log.warning if self.bad_streak <= SAID_STREAK else log.debug)(
                "step %d skipped: loss %s, grad norm %s%s%s",
                s.step,
                loss_v,
                norm_v,
                " (the gradients themselves, not an fp16 overflow)" if math.isfinite(loss_v) else "",
                "; further skipped steps of this streak at -v" if self.bad_streak == SAID_STREAK else "",
            )
            if self.bad_streak > self.cfg.amp.nonfinite_patience:
                # another precision helps a reduced-precision run only: fp32 is the most range there is
                other = " or ".join(p for p in ("bf16", "fp32") if p != self.precision)
                precision = f"use train.precision: {other}, " if self.precision != "fp32" else ""
                if self._forward_makes_nan():
                    raise TrainingError(
                        f"loss/gradients non-finite for {self.bad_streak} consecutive steps since training started: "
                        f"{FORWARD_NAN}",
                        hint=FORWARD_NAN_FIX,
                    )
                if self._user_loss_makes_nan(loss_v):
                    raise TrainingError(
                        f"loss non-finite for {self.bad_streak} consecutive steps since training started: "
                        f"{user_loss_nan(self.cfg.loss)}",
                        hint=f"make train.loss {self.cfg.loss} return a finite loss for finite outputs (guard "
                        f"divisions by zero, log(0), a mean over no entries){self._loss_precision_hint()}",
                    )
                if self._never_updated(loss_v):
                    raise TrainingError(
                        f"gradients non-finite on a finite loss at every step since training started ({s.step} "
                        f"steps, epoch {s.epoch + 1}) in {self.precision}: no step updated the weights",
                        hint=f"try train.precision: fp32 (a {self.precision} kernel of some op, such as a bfloat16 "
                        "Conv3d backward on the CPU, can give NaN gradients from the first step); if fp32 fails too, "
                        "the model's own backward is NaN (a sqrt or norm at 0)",
                    )
                if self.last_good == NO_CHECKPOINT:  # nothing to resume from: weights that answer NaN said so
                    self._refuse_diverged()
                raise TrainingError(
                    f"loss/gradients non-finite for {self.bad_streak} consecutive steps, at step "
                    f"{s.step} (epoch {s.epoch + 1}) in {self.precision}; last good checkpoint: {self.last_good}",
                    hint=f"lower train.lr, {precision}or raise train.amp.nonfinite_patience; "
                    "train.checkpoint.resume: <last.pt> continues from the checkpoint",
                )

    def _never_updated(self, loss: float) -> bool:
        """Whether no step of this run (not resumed) has updated the weights, and the last loss was finite: NaN
        gradients from the first step are the precision's or the model's, not a learning rate's, and the last
        checkpoint holds the initial weights."""
        return (
            not self.updates and self.result.resumed_from is None and math.isfinite(loss) and self.precision != "fp32"
        )

    def _user_loss_makes_nan(self, loss: float) -> bool:
        """Whether a loss of the user's was not finite at every step since training started (not resumed), on the
        model's outputs, which :meth:`_forward_makes_nan` found finite: the loss makes the NaN, not a learning rate,
        since no step has updated the weights."""
        return (
            self.cfg.loss is not None
            and not math.isfinite(loss)
            and not self.updates
            and self.result.resumed_from is None
        )

    def _loss_precision_hint(self) -> str:
        """Under reduced precision, the loss's own ops may overflow in it: fp32 is worth a try before its code."""
        return (
            "; or try train.precision: fp32 (its ops may overflow in reduced precision)"
            if self.precision != "fp32"
            else ""
        )

    def _forward_makes_nan(self) -> bool:
        """Whether no step of this run (not resumed) has updated the weights and the model's outputs on the first
        training batch are not finite (:func:`first_batch_nonfinite`): a NaN of the forward, not of training."""
        if self.updates or self.result.resumed_from is not None:
            return False
        return first_batch_nonfinite(self.model, self.data.train_x, self.device, self.eval_batch)

    def _fixed_scale_overflow(self, s: StepStats) -> None:
        """A step whose fp16 gradients overflowed the fixed loss scale on a finite loss: skipped and counted as an
        fp16 overflow (``skipped_steps``), yet toward nonfinite_patience too, since a fixed scale never backs off
        and would overflow on every later step alike."""
        scale = self.cfg.amp.loss_scale
        self.acc["skipped"] += 1
        self.bad_streak += 1
        (log.warning if self.bad_streak <= SAID_STREAK else log.debug)(
            "step %d skipped: fp16 gradients non-finite on a finite loss with the fixed loss scale %s (an overflow "
            "of train.amp.loss_scale, or NaN gradients of their own)%s",
            s.step,
            scale,
            "; further skipped steps of this streak at -v" if self.bad_streak == SAID_STREAK else "",
        )
        if self.bad_streak > self.cfg.amp.nonfinite_patience:
            raise TrainingError(
                f"fp16 gradients non-finite on a finite loss for {self.bad_streak} consecutive steps with the fixed "
                f"loss scale {scale} (an overflow of it, or NaN gradients of their own), at step {s.step} (epoch "
                f"{s.epoch + 1}); last good checkpoint: {self.last_good}",
                hint="lower train.amp.loss_scale or use train.amp.loss_scale: dynamic (it backs off from overflows "
                "and tells them from NaN gradients), or train.precision: bf16",
            )

    def _scale_can_back_off(self) -> bool:
        """Can an overflow on a finite loss still be the loss scale's fault? Not with a static scale, nor once
        the dynamic one has fallen below 1 (gradients that overflow unscaled are NaN/Inf in their own right):
        such steps count toward nonfinite_patience, so a NaN-gradient bug aborts instead of skipping forever.
        A host read of the scale, on overflow steps only."""
        return self.cfg.amp.loss_scale == "dynamic" and self.scaler.get_scale() >= 1.0

    def _loss_finite_everywhere(self, loss_v: float, norm_v: float) -> bool:
        """Was this step's loss finite on every process? Each process has its own loss, so under DDP one
        NaN loss would make one process count a NaN step and the others an fp16 back-off, and only some
        would abort (the rest then hang). The non-finite norm is the same on every process (all-reduced
        gradients), so all of them ask here for the same step: a collective only on such steps."""
        finite = math.isfinite(loss_v)
        if self.env.enabled and not math.isfinite(norm_v):
            finite = all_sum([0.0 if finite else 1.0], self.device, self.env)[0] == 0.0
        return finite

    def _epoch_metrics(self) -> EpochMetrics:
        a, cfg = self.acc, self.cfg
        loss, seen, samples, secs, skipped, bad = all_sum(
            [a["loss"], a["seen"], a["samples"], a["secs"], a["skipped"], a["nonfinite"]], self.device, self.env
        )
        # NaN when every step of the epoch was non-finite: there is no mean loss to report (0.0 would look good)
        mean_loss = loss / seen if seen else math.nan
        m = EpochMetrics(
            self.epoch + 1,
            mean_loss,
            samples / max(secs / self.env.world_size, 1e-9),
            self.steps_per_epoch,
            self.opt.param_groups[0]["lr"],
            peak_memory_mb=round(peak_memory_mb(self.device), 1),
            loss_scale=self.scaler.get_scale() if self.scaler.is_enabled() else None,
            skipped_steps=int(skipped / self.env.world_size),
            nonfinite_steps=int(bad / self.env.world_size),
        )
        if (self.epoch + 1) % cfg.eval_every == 0 or self.epoch + 1 == cfg.epochs:
            with running_user_code(f"evaluating the model after epoch {self.epoch + 1}", model=True):
                m.val_loss, m.val_accuracy = evaluate_loss_acc(
                    self.model,
                    self.data.val_x,
                    self.data.val_y,
                    self.device,
                    self.env,
                    batch=self.eval_batch,
                    task=self.task,
                    forward=self.net,
                )
            if not math.isfinite(m.val_loss):  # said once per evaluation: a NaN the loss curve would just drop
                self.nan_outputs = (*self._count_nan_rows(), self.updates)
                log.warning("the validation loss after epoch %d is %s: %s", self.epoch + 1, m.val_loss, self._why_nan())
            if self._improves(m) and not self._weights_give_nan():  # weights of NaN outputs are never the best
                self._keep_best(m)
        return m

    def _count_nan_rows(self) -> tuple[int, int]:
        """(rows answered with NaN/Inf, rows) of the held-out set at the current weights (:func:`nonfinite_rows`)."""
        return nonfinite_rows(self.model, self.data.val_x, self.device, self.env, self.eval_batch, self.net)

    def _why_nan(self) -> str:
        """Why the validation loss is not finite, in words: weights that an update blew up (NaN/Inf outputs on most
        rows after updates), the model's forward (on some rows), or (finite outputs) the loss."""
        bad, total, _ = self.nan_outputs or (0, 0, 0)
        if self.updates and self._weights_give_nan():
            return (
                f"the weights the updates reached answer {bad} of the {total} held-out rows with NaN or infinity: an "
                "update blew them up (a learning rate too high; lower train.lr)"
            )
        if bad:
            return (
                f"the model answers {bad} of the {total} held-out rows with NaN or infinity: its forward makes them "
                "(a softmax over a row whose attention scores are all masked to -inf gives NaN, in the model's own "
                "attention or torch's)"
            )
        if self.cfg.loss is not None:
            return user_loss_nan(self.cfg.loss)
        return "the model's outputs are finite: the loss of them is not (check the held-out labels)"

    def _improves(self, m: EpochMetrics) -> bool:
        """Whether epoch ``m`` beats the best so far: by validation accuracy where there are classes (at equal
        accuracy, by a lower validation loss: a small validation set ties often), else (float targets, or a user
        loss without class logits) by validation loss, lower and finite."""
        r = self.result
        if m.val_accuracy is not None:
            if r.best_val_accuracy is None or m.val_accuracy > r.best_val_accuracy:
                return True
            tie = self.best_tie_loss
            lower = m.val_loss is not None and math.isfinite(m.val_loss) and (tie is None or m.val_loss < tie)
            return m.val_accuracy == r.best_val_accuracy and lower
        if m.val_loss is None or not math.isfinite(m.val_loss):
            return False
        return r.best_val_loss is None or m.val_loss < r.best_val_loss

    def _keep_best(self, m: EpochMetrics) -> None:
        r = self.result
        r.best_epoch, r.best_by = m.epoch, "val_accuracy" if m.val_accuracy is not None else "val_loss"
        r.best_val_accuracy, self.best_tie_loss = m.val_accuracy, m.val_loss
        r.best_val_loss = m.val_loss if m.val_accuracy is None else None
        if self.ckpt_dir is not None and self.env.is_main:
            self.best_digest = ckpt.save_weights(self.ckpt_dir / ckpt.BEST, self.model)

    def _load_best(self) -> None:
        from safetensors.torch import load_file

        if self.env.is_main:
            best = self.ckpt_dir / ckpt.BEST
            load_weights(self.model, load_file(str(best), device=str(self.device)), str(best))
            r = self.result
            score = r.best_val_accuracy if r.best_by == "val_accuracy" else r.best_val_loss
            log.info("selected the best epoch's weights: epoch %s, by %s (%s)", r.best_epoch, r.best_by, fmt(score))

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
