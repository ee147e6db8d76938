"""Pipeline entry of the train stage: train the configured model, or take a user's checkpoint.

With ``train.distributed.nproc_per_node`` > 1 the stage runs ``torchrun`` (``launch.py``) whose rank 0
writes the weights into the stage's folder; otherwise it trains in this process.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import itertools
import logging
import math
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from kiln.core.compare import class_axis
from kiln.core.data import (
    DataContractError,
    DatasetSplits,
    call,
    check_axes_name_inputs,
    check_forward_takes,
    forward_inputs,
    input_names,
    rebuild,
    rows,
    take,
    tensors,
)
from kiln.core.errors import ConfigError, ModelError, TrainingError
from kiln.core.feeds import shape_fix
from kiln.core.inputs import batch_of_one_hint
from kiln.core.labels import is_label_name, is_loss_name
from kiln.core.output_names import refuse_unknown_gated
from kiln.core.outputs import flatten_outputs, logits_name
from kiln.core.progress import Progress
from kiln.core.records import TensorSpec
from kiln.core.stage import StageContext
from kiln.core.text import FEATURE_NAMES, first_line, fmt
from kiln.core.user_errors import UserCodeError, running_user_code, user_code_error, user_frame, where
from kiln.models.determinism import refuse_random
from kiln.models.model_io import keep_trained, load_weights, read_state_dict, save_trained, torch_model_named
from kiln.models.registry import build_model
from kiln.stages.train.checkpoint import run_key
from kiln.stages.train.declaration import TrainSettings, TrainSummary
from kiln.stages.train.dist import env_from_torchrun, process_group
from kiln.stages.train.launch import run_torchrun
from kiln.stages.train.loop import FORWARD_NAN, FORWARD_NAN_FIX, evaluate_loss_acc, first_batch_nonfinite, train
from kiln.stages.train.metrics import EpochMetrics, TrainResult
from kiln.stages.train.precision import resolve_device
from kiln.stages.train.task import DECODER_FIX, Task, check_task, from_torch, label_free, scoring_task, task_for


def build_seeded(config: TrainSettings) -> nn.Module:
    """Build the model right after seeding, so its initial weights depend on ``seed`` alone."""
    torch.manual_seed(config.seed)
    return build_model(config.model.name, config.model.params)


def checkpoint_dir(config: TrainSettings, cache_dir: Path) -> Path:
    if config.train.checkpoint.dir:
        return Path(config.train.checkpoint.dir)
    return cache_dir / "train" / run_key(config.dump())


def trained_from(key_parts: dict[str, Any]) -> dict[str, Any] | None:
    """The code and data the weights depend on besides the settings: the ``code``, ``user_code`` and ``user_data``
    parts of the stage's cache key (Kiln's training code, the user's model/data/loss code, the data's hash; the
    runner's ``ctx.key_parts``). An interrupted run resumes only from a checkpoint trained from the same (the
    settings are in the run key). None outside the runner: nothing to compare."""
    if not key_parts:
        return None
    return {part: key_parts.get(part) for part in ("code", "user_code", "user_data")}


def train_to(
    out: Path,
    config: TrainSettings,
    data: DatasetSplits,
    ckpt_dir: Path,
    progress: Progress | None = None,
    sources: dict[str, Any] | None = None,
) -> TrainSummary:
    """Train and (main process only) write ``model.safetensors`` + ``model.json`` + ``loss.png`` into ``out``.
    ``sources``: what the run trains from (:func:`trained_from`), which a resumed checkpoint must match.

    Shared by the stage and by ``kiln.stages.train.worker`` (one call per torchrun process)."""
    env = env_from_torchrun()
    device = resolve_device(config.train, env.local_rank if env.enabled else None)
    model = build_seeded(config)
    probe = min(2, config.train.batch_size)  # a model of one sample a call (a graph as a batch of one) trains at 1
    probed = probe_copy(model)  # the checks' forward passes leave the model to train as it was built
    if data.train_y is None and config.train.loss is None:  # labels left among the inputs: named first
        check_model_fits_data(probed, data, config.model.name, None, config.signature.logits_output, probe)
        raise ConfigError(
            f"dataset '{data.name}' has no labels (train_y is None): training needs them",
            hint="return train_y/val_y from the data function, give train.loss, a loss of yours that reads no labels "
            "(an in-batch contrastive one: it is called as loss(outputs, None)), set train.enabled: false, or give "
            "model.checkpoint",
        )
    with said_warnings(logging.getLogger("kiln.train")) as data_warnings:
        if data.train_y is None:
            task, data = label_free(data, config.train.loss, config.signature.logits_output)
        else:
            task = task_for(data, config.train.loss, config.signature.logits_output)
    checked = task if task.labels else None  # placeholder labels: nothing of theirs to check against the outputs
    gated = config.gated_outputs  # validate.gates.gated_outputs: checked on the probe, keyed by nothing
    fitted = check_model_fits_data(
        probed, data, config.model.name, checked, config.signature.logits_output, probe, gated
    )
    task = fitted or task  # the output the loss reads, chosen on the probe where the config names none
    check_axes_name_inputs(model, data.train_x, config.signature.dynamic_axes)
    del probed
    with process_group(env, config.train.distributed, device):
        result = train(
            model,
            data,
            config.train,
            seed=config.seed,
            progress=progress,
            env=env,
            ckpt_dir=ckpt_dir,
            run_key=run_key(config.dump()),
            out_dir=out,
            task=task,
            sources=sources,
        )
    check_learned(result, lambda: first_batch_nonfinite(model, data.train_x, device, config.train.batch_size))
    chance = chance_loss(task, data.num_classes)
    if not warn_learned_nothing_held_out(result.history, chance):
        warn_at_chance(result, data.num_classes, chance)
    warn_diverged(result.history, chance)
    if env.is_main:
        save_trained(out, model, config.model, {"dataset": data.name, "input_shapes": data.sample_shapes})
    return TrainSummary.model_validate({**result.summary(), "data_warnings": data_warnings})


@contextmanager
def said_warnings(logger: logging.Logger) -> Iterator[list[str]]:
    """The warnings ``logger`` says inside the block, as messages; they are logged as ever."""
    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    handler = Keep(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield said
    finally:
        logger.removeHandler(handler)


def check_learned(result: TrainResult, forward_nan: Callable[[], bool] | None = None) -> None:
    """A training in which no optimizer step was taken (each one skipped for a non-finite loss or an fp16 overflow)
    learned nothing: an error, never weights that go on to pass every gate against themselves. ``forward_nan``: at
    the weights no step updated, whether the model's outputs on the first batch are not finite, asked only where
    steps were skipped for a non-finite loss: then the forward makes the NaN, and the fix is in the model."""
    planned = sum(m.steps for m in result.history)
    nonfinite = sum(m.nonfinite_steps for m in result.history)
    overflow = sum(m.skipped_steps for m in result.history)
    if not planned or nonfinite + overflow < planned:
        return
    said = (
        f"no training step was taken: all {planned} were skipped ({nonfinite} with a non-finite loss or gradients, "
        f"{overflow} for fp16 gradient overflow); the model learned nothing"
    )
    if nonfinite and result.resumed_from is None and forward_nan is not None and forward_nan():
        raise TrainingError(f"{said}: {FORWARD_NAN}", hint=FORWARD_NAN_FIX)
    raise TrainingError(said, hint=_none_taken_fix(nonfinite, overflow))


def _none_taken_fix(nonfinite: int, overflow: int) -> str:
    """The fix for a training whose every step was skipped: fp16 overflows alone are the loss scale's to fix."""
    if overflow and not nonfinite:
        return (
            "the scaled fp16 gradients overflowed at every step: use train.amp.loss_scale: dynamic or a lower fixed "
            "scale, or train.precision: bf16"
        )
    return "check the data and the loss for NaN/Inf, lower train.lr, or use train.precision: bf16 or fp32"


# A rise of held-out accuracy smaller than this is none (warn_learned_nothing_held_out)
ROOM_TO_RISE = 0.01
# A held-out loss that falls below this share of the first epoch's, and of chance level, shows learning
# (warn_learned_nothing_held_out)
HELD_OUT_FALL = 0.75


def chance_loss(task: Task, num_classes: int) -> float | None:
    """The held-out loss of a model that answers at chance: ``ln(num_classes)``, the cross-entropy of uniform class
    scores, where the loss is Kiln's own cross-entropy over classes; None where it is unknown (a train.loss of the
    user's, float targets, fewer than two classes)."""
    if task.kind != "classification" or task.user_loss is not None or num_classes < 2:
        return None
    return math.log(num_classes)


def held_out_loss_fell(scored: list[EpochMetrics], chance: float | None) -> bool:
    """Whether the validation loss fell clearly (to under :data:`HELD_OUT_FALL` of the first epoch's) and below
    chance level ``chance`` too (under :data:`HELD_OUT_FALL` of it): the model learned something that shows on the
    held-out rows, even where accuracy moves little (a tagger whose labels are mostly one class starts near its
    final accuracy). A loss that falls yet stays above chance is no such sign: a model answering at chance in eval
    mode (BatchNorm statistics far from its batches') can start far above it and fall as its logits shrink. Where
    chance is unknown (None), a falling loss shows nothing."""
    first = scored[0].val_loss
    if chance is None or first is None or not math.isfinite(first):
        return False
    later = [m.val_loss for m in scored[1:] if m.val_loss is not None and math.isfinite(m.val_loss)]
    return bool(later) and min(later) < HELD_OUT_FALL * min(first, chance)


# A training loss this many times chance level at the end is a diverged training (warn_diverged)
DIVERGED = 10.0


def warn_diverged(history: list[EpochMetrics], chance: float | None) -> None:
    """Warn where the last epoch's training loss is still :data:`DIVERGED` times the loss of answering at chance
    (``chance``: :func:`chance_loss`) or more: a learning rate too high blows the loss up while every number stays
    finite, so no skipped step says so, and the run would go on to validate weights that answer worse than chance."""
    last = next((m.loss for m in reversed(history) if math.isfinite(m.loss)), None)
    if chance is None or last is None or last < DIVERGED * chance:
        return
    logging.getLogger("kiln.train").warning(
        "the training loss ended at %.3g, %.0f times the %.3g of answering at chance: the training diverged; lower "
        "train.lr",
        last,
        last / chance,
        chance,
    )


def warn_learned_nothing_held_out(history: list[EpochMetrics], chance: float | None = None) -> bool:
    """Say where the training loss fell by more than half after the first epoch while validation accuracy never rose
    above the first epoch's (and had room to: a first epoch right on nearly every row has learned the task) and the
    validation loss did not fall clearly below the first epoch's and chance level ``chance`` either
    (:func:`held_out_loss_fell`): what the model learned does not show in eval mode or on the held-out rows. A model
    whose BatchNorm keeps running statistics far from its batches' (a small momentum) or that branches on
    ``self.training`` trains well and answers at chance in eval mode, and validation then passes engines that
    agree with a model that does nothing; labels that do not belong to their inputs look the same. A training loss
    that never got below ``chance`` learned nothing at all: said so, with :func:`_above_chance_fix`, not as eval
    mode's. Returns whether it warned, so that :func:`warn_at_chance` does not say it again."""
    scored = [m for m in history if m.val_accuracy is not None and math.isfinite(m.loss)]
    if len(scored) < 3:
        return False
    first, last = scored[0], scored[-1]
    if first.val_accuracy + ROOM_TO_RISE >= 1.0 or held_out_loss_fell(scored, chance):
        return False
    if not (last.loss < 0.5 * first.loss and max(m.val_accuracy for m in scored) <= first.val_accuracy + ROOM_TO_RISE):
        return False
    fell = f"training loss fell from {first.loss:.3g} (epoch {first.epoch}) to {last.loss:.3g} (epoch {last.epoch})"
    if chance is not None and min(m.loss for m in scored) >= chance:  # never learned: nothing to seek in eval mode
        logging.getLogger("kiln.train").warning(
            "%s, yet never below the %.4g of answering at chance (ln of the classes), and validation accuracy %s: "
            "the model learned nothing. %s",
            fell,
            chance,
            _accuracies_said(scored),
            _above_chance_fix(history, chance),
        )
        return True
    logging.getLogger("kiln.train").warning(
        "%s, yet validation accuracy %s: what the model learned does not show on the held-out rows. Check that "
        "forward computes alike in model.eval() (a BatchNorm with a small momentum keeps running statistics far from "
        "its batches'; a branch on self.training) and that val_y labels val_x as train_y labels train_x",
        fell,
        _accuracies_said(scored),
    )
    return True


def _accuracies_said(scored: list[EpochMetrics]) -> str:
    """The epochs' validation accuracies in words: "stayed at 0.086" where they are all alike (to three places),
    else each epoch's (the first three and the last where there are more than five)."""
    said = [f"{m.val_accuracy:.3f}" for m in scored]
    if len(set(said)) == 1:
        return f"stayed at {said[0]}"
    shown = said if len(said) <= 5 else [*said[:3], "...", said[-1]]
    return f"did not rise (by epoch: {', '.join(shown)})"


# What to check of a model that answers at chance level with updates of a sound size
CHANCE_FIX = (
    "Check that train_y labels train_x (and val_y val_x), then train longer (train.epochs) or at another train.lr"
)
# A first epoch whose mean training loss is this many times chance level rose above it: the updates, not too few
# of them, keep the model from learning (_above_chance_fix)
ROSE_ABOVE_CHANCE = 1.25


def _above_chance_fix(history: list[EpochMetrics], chance: float) -> str:
    """What to change where the training loss stays at or above ``chance``: an initialised classifier starts near
    chance level, so a first epoch well above it (:data:`ROSE_ABOVE_CHANCE`) was pushed there by updates too large;
    otherwise the training was too short, or the labels do not belong to their inputs."""
    first = next((m for m in history if math.isfinite(m.loss)), None)
    if first is not None and first.loss >= ROSE_ABOVE_CHANCE * chance:
        return (
            f"The loss rose above chance in epoch {first.epoch} ({first.loss:.3g}): updates too large; lower "
            "train.lr (e.g. 10 times)"
        )
    return CHANCE_FIX


# Held-out accuracy at most this far above 1/num_classes (and half of that at most) is chance level (warn_at_chance)
CHANCE_MARGIN = 0.05
# Where no held-out accuracy was measured, a final training loss at least this share of ln(num_classes) is chance
# level (warn_at_chance)
CHANCE_LOSS_SHARE = 0.95


def warn_at_chance(result: TrainResult, num_classes: int, chance: float | None) -> None:
    """Warn where the trained model answers at chance level: the held-out accuracy of the weights returned is at most
    1/num_classes plus :data:`CHANCE_MARGIN` (half of chance at most, so a 100-class model at five times chance is
    not said to be), or the last epoch's training loss is still ``chance`` (:func:`chance_loss`, the loss of uniform
    scores) or more (whatever the accuracy: a little above chance on few held-out rows proves nothing), or, where no
    accuracy was measured, :data:`CHANCE_LOSS_SHARE` of it or more. Validation then holds engines to a
    model that does nothing, which every gate passes and which proves little; labels that do not belong to their
    inputs, or a training too short, look the same. Quiet where ``chance`` is unknown (regression, a loss of the
    user's)."""
    if chance is None or num_classes < 2:
        return
    chosen = result.selected()
    accuracy = chosen.val_accuracy if chosen is not None else None
    last = next((m.loss for m in reversed(result.history) if math.isfinite(m.loss)), None)
    level = 1.0 / num_classes
    said = []
    if accuracy is not None and accuracy <= level + min(CHANCE_MARGIN, level / 2):
        said.append(f"held-out accuracy {accuracy:.4f} on {num_classes} classes, chance {level:.4f}")
    if last is not None and last >= chance:  # accuracy a little above chance on a few held-out rows proves nothing
        said.append(f"final training loss {last:.4g}, not below the ln({num_classes}) = {chance:.4g} of uniform scores")
        val_loss = chosen.val_loss if chosen is not None else None
        if val_loss is not None and math.isfinite(val_loss) and val_loss >= chance:
            said[-1] += f", validation loss {val_loss:.4g}"
    elif accuracy is None and last is not None and last >= CHANCE_LOSS_SHARE * chance:
        said.append(f"final training loss {last:.4g}, the ln({num_classes}) = {chance:.4g} of uniform scores")
    if not said:
        return
    logging.getLogger("kiln.train").warning(
        "the trained model predicts at chance level (%s): engines that agree with it prove little. %s",
        "; ".join(said),
        _above_chance_fix(result.history, chance) if last is not None and last >= chance else CHANCE_FIX,
    )


def check_fp32(model: nn.Module, model_ref: str) -> None:
    """The factory's model holds FP32 weights: Kiln keeps FP32 master weights (train.precision runs the math in
    bf16/fp16 under autocast) and exports FP32, from which the precision stage makes its variants. A model in
    bfloat16 (``torch_dtype=torch.bfloat16``) trained its weights in bf16 and failed at export."""
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.is_floating_point()})
    if dtypes and dtypes != ["float32"]:
        raise ModelError(
            f"model '{model_ref}' has {', '.join(dtypes)} weights: Kiln trains and exports FP32 weights and makes the "
            "lower precisions itself",
            hint="return the model in float32 (drop .half()/.bfloat16()/.to(dtype) or torch_dtype= from the factory); "
            "train.precision: bf16 or fp16 runs training in that precision, precision.variants makes the engines'",
        )


def _input_names(model: nn.Module, x: Any) -> list[str]:
    """The data's inputs by name: a dict's keys, or ``forward``'s parameters for positional ones."""
    if isinstance(x, dict):
        return list(x)
    params = list(inspect.signature(model.forward).parameters)
    return params[: len(x)] if isinstance(x, (tuple, list)) else params[:1]


def _loss_goes_without(model: nn.Module, x: dict[str, Any], key: str) -> bool:
    """Whether the model, called without input ``key`` of ``x``, runs and returns no scalar ``loss``
    (:func:`kiln.core.labels.is_loss_name`): Hugging Face's models return their loss only where given their labels,
    whatever the labels' name. A forward that needs the key (an error without it) says nothing."""
    try:
        with torch.no_grad():
            out = flatten_outputs(call(model, {k: v for k, v in x.items() if k != key}))
    except Exception:  # noqa: BLE001 - a required input: the loss alone reads it where only the loss follows it
        return _only_the_loss_follows(model, x, key)
    return not any(is_loss_name(n) and t.ndim == 0 for n, t in out.items())


def _only_the_loss_follows(model: nn.Module, x: dict[str, Any], key: str) -> bool:
    """Whether, with input ``key`` of ``x`` changed (its floats shifted, its integers rolled over the batch), the
    model's scalar ``loss`` changes and no other output does: a required argument that only the loss reads (a
    forward(past, future) returning the forecast and its loss against the future)."""
    value = x[key]
    if not isinstance(value, torch.Tensor) or value.ndim == 0 or len(value) < 2:
        return False
    other = value + 1 if value.is_floating_point() else value.roll(1, 0)
    try:
        with torch.no_grad():
            before = flatten_outputs(call(model, x))
            after = flatten_outputs(call(model, {**x, key: other}))
    except Exception:  # noqa: BLE001 - values the model cannot take: no evidence either way
        return False
    losses = [n for n, t in before.items() if is_loss_name(n) and t.ndim == 0]
    rest = [n for n in before if n not in losses]
    changed = lambda n: not torch.equal(before[n], after.get(n, before[n]))  # noqa: E731
    return bool(losses) and any(changed(n) for n in losses) and not any(changed(n) for n in rest)


def _label_among(model: nn.Module, x: Any, outputs: dict[str, torch.Tensor]) -> str | None:
    """The inputs that make the model return a scalar (its loss), quoted: those named like labels (every one: a
    question-answering head's start and end positions), else, beside a scalar ``loss``, a dict key without which
    the model returns none. None where no input does."""
    labels = [n for n in _input_names(model, x) if is_label_name(n)]
    if labels:
        return " and ".join(f"'{n}'" for n in labels)
    if not isinstance(x, dict) or not any(is_loss_name(n) and t.ndim == 0 for n, t in outputs.items()):
        return None
    was = model.training
    model.eval()  # no dropout, and no BatchNorm statistics moved by the probes
    try:
        return next((f"'{k}'" for k in x if _loss_goes_without(model, x, k)), None)
    finally:
        model.train(was)


def _refuse_labels_in_inputs(model: nn.Module, x: Any, outputs: dict[str, torch.Tensor]) -> None:
    """Labels among the inputs (a Hugging Face model's ``labels`` or its forecasters' ``future_values``, nanoGPT's
    ``targets``, or a key without which the model returns no ``loss``) make the model return its loss, a scalar no
    engine can answer per sample: the export refuses it, so say it before training rather than after."""
    losses = sorted((n for n, t in outputs.items() if t.ndim == 0), key=lambda n: not is_loss_name(n))
    label = _label_among(model, x, outputs) if losses else None
    if label is not None:
        raise DataContractError(
            f"the model's output '{losses[0]}' is a scalar with its input{'s' if ' and ' in label else ''} {label} "
            "among the data's inputs (a loss): an engine answers one row per sample, and its clients have no labels "
            "to send",
            hint=f"keep {label} out of the data's inputs (x): return the labels as y (train_y/val_y), from which "
            "training computes the loss (train.loss); or return only per-sample outputs from forward",
        )


# Models of more parameter bytes than this are probed themselves: a copy would double the memory training starts with
PROBE_COPY_BYTES = 2 << 30


def probe_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` for the checks' forward passes before training (:func:`check_model_fits_data`), so that a
    model whose first call changes it (a paper's data-aware initialization, NODE's trees set from their first batch)
    trains from its first training batch, not from the checks' two rows. ``model`` itself where a copy would not do:
    lazy modules, whose first call makes the parameters the optimizer needs (from the shapes alone), a model too
    large to hold twice (:data:`PROBE_COPY_BYTES`), or one that cannot be copied."""
    params = list(model.parameters())
    if any(nn.parameter.is_lazy(p) for p in params):
        return model
    if sum(p.numel() * p.element_size() for p in params) > PROBE_COPY_BYTES:
        return model
    try:
        return copy.deepcopy(model)
    except Exception as exc:  # noqa: BLE001 - a module deepcopy refuses (a handle to a file): probed itself
        logging.getLogger("kiln.train").debug("model not copied for the checks: %s", first_line(str(exc)))
        return model


def check_model_fits_data(
    model: nn.Module,
    data: DatasetSplits,
    model_ref: str,
    task: Task | None = None,
    logits_output: str | int | None = None,
    probe_rows: int = 2,
    gated_outputs: list[str] | None = None,
) -> Task | None:
    """One forward pass on two samples (``probe_rows``: fewer where training takes fewer a step: a model of one
    sample a call, a graph given as a batch of one, trains at ``train.batch_size: 1``), so that data which does not
    fit the model fails with a clear message
    before training starts (and not as a traceback from deep inside the loop); ``signature.logits_output`` is one
    of its outputs (a misspelt name was said only at the precision stage, after training, with a loss of the
    user's that never reads it), as is each of ``validate.gates.gated_outputs`` (``gated_outputs``, which
    validation would check only after training and the build); and that the model answers the same rows alike from
    call to call in eval mode (:func:`~kiln.models.determinism.refuse_random`), which the export would refuse only
    after the training. Returns ``task`` as training should use it: reading the one output shaped like the targets
    where several outputs leave the loss's unnamed (:func:`_with_target_output`); None where no task was given."""
    check_fp32(model, model_ref)
    x = take(data.train_x if rows(data.train_x) else data.val_x, slice(0, probe_rows))
    check_forward_takes(model, x, model_ref)
    with EmbeddingLookups(x) as lookups:
        out = _probe(model, data, x, model_ref, lookups)
    check_token_ids(model, data, x, lookups)
    outputs = flatten_outputs(out, f"model '{model_ref}'")  # every output a tensor (or None, left out)
    if logits_output is not None:
        logits_name(list(outputs), logits_output)  # a ConfigError naming the outputs where it is none of them
    refuse_unknown_gated(gated_outputs, list(outputs))
    _refuse_outputs_named_like_inputs(model, x, outputs)
    _refuse_labels_in_inputs(model, x, outputs)
    _refuse_random_in_eval(model, x)
    y = data.train_y if data.train_y is not None else data.val_y
    if task is not None and y is not None:
        task = _with_target_output(task, outputs, y[:probe_rows], data.num_classes)
        lengths = tuple({d for t in tensors(x) if t.ndim >= 2 for d in t.shape[1:]})  # what labels may follow
        check_task(task, out, y[:probe_rows], data.num_classes, model_ref, _lacks_decoder_inputs(model, x), lengths)
    return task


def _with_target_output(task: Task, outputs: dict[str, torch.Tensor], y: torch.Tensor, num_classes: int) -> Task:
    """``task`` reading the one output shaped like the targets ``y`` (:func:`_shaped_like`) where the loss's output
    is otherwise unnamed: several outputs, none named by signature.logits_output nor the default ``logits`` (a
    forecaster's ``prediction_outputs`` beside its ``loc`` and ``scale``); one named like features
    (:data:`~kiln.core.text.FEATURE_NAMES`) is none, as where it is the only output. Said once, since it is a choice
    made for the user. Unchanged where none or several fit (the loss then asks which), or where train.loss is a
    function of the user's, which reads the outputs as forward returns them."""
    if task.logits_output is not None or logits_name(list(outputs), None) is not None:
        return task
    if task.user_loss is not None and not from_torch(task.user_loss):
        return task
    fits = [n for n, t in outputs.items() if _shaped_like(t, y, task.kind, num_classes) and not FEATURE_NAMES.search(n)]
    if len(fits) != 1:
        return task
    shape = "[" + ", ".join(["N", *(str(d) for d in outputs[fits[0]].shape[1:])]) + "]"
    what = "targets: the only output shaped like them"
    if task.kind == "classification":
        what = "labels: the only output of their shape plus a class axis"
    logging.getLogger("kiln.train").warning(
        "training '%s' against the %s %s; set signature.logits_output to choose another", fits[0], what, shape
    )
    return dataclasses.replace(task, logits_output=fits[0])


def _shaped_like(output: torch.Tensor, y: torch.Tensor, kind: str, num_classes: int) -> bool:
    """Whether ``output`` is what the built-in loss of ``kind`` reads against the targets ``y``, as the checks of
    a single output take it (:func:`~kiln.stages.train.task.check_task`): class logits of the integer labels' shape
    plus a class axis (``num_classes`` wide where the data declares it), one logit per row of binary labels, else the
    targets' own shape."""
    if output.ndim == 0 or len(output) != len(y):
        return False
    if kind == "classification":
        axis = class_axis(output.ndim) % output.ndim
        positions = output.shape[:axis] + output.shape[axis + 1 :]
        width_fits = num_classes <= 0 or output.shape[axis] == num_classes
        return output.ndim == y.ndim + 1 and tuple(positions) == tuple(y.shape) and width_fits
    if kind == "binary":
        return output.ndim in (1, 2) and output.numel() == len(y)
    return tuple(output.shape) == tuple(y.shape)


def _refuse_outputs_named_like_inputs(model: nn.Module, x: Any, outputs: dict[str, torch.Tensor]) -> None:
    """Outputs named like inputs (a diffusers UNet's ``forward(sample=...)`` returning ``{"sample": eps}``) cannot both
    be names of one ONNX graph: the export refuses them (``name_io``, the same names: :func:`input_names` and
    :func:`flatten_outputs`), so say it before training rather than after it."""
    clash = sorted(set(outputs) & set(input_names(model, x)))
    if clash:
        raise ModelError(
            f"the model's outputs {clash} are named like its inputs; an ONNX graph cannot have both",
            hint="rename those outputs (the keys of the dict forward() returns) or the inputs: the simplest is a "
            f"wrapper module whose forward returns {{'noise_pred': self.model(...)['{clash[0]}']}}, or rename the "
            "input (its key in the data function's dict and the forward() parameter it fills)",
        )


def _probe(model: nn.Module, data: DatasetSplits, x: Any, model_ref: str, lookups: EmbeddingLookups) -> Any:
    """The model's outputs on the probe rows ``x`` in eval mode, or one error naming what it cannot take: a token
    id past an embedding's rows (:func:`check_token_ids`, from the ``lookups`` recorded), else the forward's own
    error."""
    try:
        with torch.no_grad():
            return call(model.eval(), x)
    except (RuntimeError, ValueError, IndexError, TypeError) as exc:
        check_token_ids(model, data, x, lookups)
        across = _indexed_across_rows(model, data, x, exc, lookups)
        if across is not None:
            raise _rows_not_samples(model, data, x, model_ref, across, exc) from None
        raise _index_error(exc, model_ref) or _cannot_take(model, data, x, model_ref, exc) from None
    except Exception as exc:  # any other error of the user's forward: theirs, named by file and line
        err = user_code_error(exc, "checking the model on two samples of the data", f"model '{model_ref}'", model=True)
        if err is None:
            raise
        raise err from exc
    finally:
        model.train()


# torch's messages for an index past the tensor an indexing op reads (``index_select``, ``gather``, ``scatter``,
# ``index_add``, ``x[idx]``, an embedding); not ``topk``'s "selected index k out of range", which no index input makes
INDEXING_FAILED = re.compile(r"index out of range in self|index -?\d+ is out of bounds for dimension")
# torch.topk asked for more entries than its axis has: the model's own line, whatever the data
TOPK_FAILED = re.compile(r"selected index k out of range")
# The most rows the across-rows check runs the model on at once: past it the error is taken as the model's
FULL_RUN_ROWS = 8192


def _indexed_across_rows(
    model: nn.Module, data: DatasetSplits, x: Any, exc: Exception, lookups: EmbeddingLookups
) -> int | None:
    """The position of an integer input whose values index the split's rows, where the forward failed on the probe
    rows ``x`` with an indexing op's error (:data:`INDEXING_FAILED`): values past the probe's rows but within the
    split's (a neighbour list ``[N, k]`` into nodes ``[N, F]``), an input the probe looked up in no embedding table
    (token ids are no row indices), and a model that runs on all the split's rows at once, say the rows are one
    sample, not independent samples a slice of which the model takes. None otherwise: the error is the model's."""
    if not INDEXING_FAILED.search(str(exc)):
        return None
    full = data.train_x if rows(data.train_x) else data.val_x
    n = rows(full)
    if n > FULL_RUN_ROWS:  # a forward pass over the whole split to confirm it would cost more than the error is worth
        return None
    found = None
    for i, (part, whole, before) in enumerate(zip(tensors(x), tensors(full), lookups.before)):
        if part.is_floating_point() or part.is_complex() or part.dtype == torch.bool or not part.numel():
            continue
        if _tables(part, before, lookups) or _shifted_tables(model, part, before, lookups):
            continue  # ids of an embedding, not of rows
        if rows(x) <= int(part.max()) and int(whole.min()) >= 0 and int(whole.max()) < n:
            found = i
            break
    return found if found is not None and _runs(model, full) else None


def _index_error(exc: Exception, model_ref: str) -> UserCodeError | None:
    """An indexing error of the model's own (an index past a tensor, ``topk`` asked for more than it has) as the
    user's code's error, named by its file and line (:func:`~kiln.core.user_errors.user_code_error`); None for any
    other error, or one raised where no frame is the user's: the data may be at fault (:func:`_cannot_take`)."""
    if not INDEXING_FAILED.search(str(exc)) and not TOPK_FAILED.search(str(exc)):
        return None  # "Dimension out of range" and the like: data missing an axis as likely as the model (_cannot_take)
    return user_code_error(exc, "checking the model on two samples of the data", f"model '{model_ref}'", model=True)


def _rows_not_samples(
    model: nn.Module, data: DatasetSplits, x: Any, model_ref: str, index: int, exc: Exception
) -> ModelError:
    """The error for rows that are no independent samples: the input at ``index`` indexes across the rows
    (:func:`_indexed_across_rows`), so the model takes all of them at once, as one sample: a batch of one."""
    full = data.train_x if rows(data.train_x) else data.val_x
    names, parts = _shown_names(model, x), tensors(full)
    specs = [TensorSpec(name=n, shape=list(t.shape), dtype=str(t.dtype)) for n, t in zip(names, parts)]
    return ModelError(
        f"model '{model_ref}' cannot take {rows(x)} of the dataset's rows alone ({first_line(exc, 120)}): input "
        f"{names[index]} holds indices into all {rows(full)} rows, so the rows are not independent samples (the "
        "model indexes across rows)",
        hint=f"{batch_of_one_hint(specs)}; give the labels as y[None] (one row of labels per sample)",
    )


def _cannot_take(model: nn.Module, data: DatasetSplits, x: Any, model_ref: str, exc: Exception) -> ModelError:
    """The error for a forward that failed on the probe rows ``x``: each input by name (:func:`_shown_names`),
    shape and dtype, the forward's own message and line. Its fix names the inputs to convert where their dtype or
    layout, not the model, is what failed (:func:`_data_fix`), and says the decoder inputs where the lack of them
    is (:func:`_wants_decoder_inputs`): else it points at the data, the model's params and the forward's line."""
    parts, names = tensors(x), _shown_names(model, x)
    what = (
        f"input {tuple(parts[0].shape)} ({parts[0].dtype})"
        if len(parts) == 1
        else "inputs (" + ", ".join(f"{n} {tuple(t.shape)} {t.dtype}" for n, t in zip(names, parts)) + ")"
    )
    frame = user_frame(exc)
    if _wants_decoder_inputs(model, x):
        return ModelError(
            f"model '{model_ref}' cannot take the dataset's {what}: decoder_input_ids is missing, which its forward "
            f"takes and the data lacks ({first_line(exc, 200)})",
            hint=DECODER_FIX,
        )
    hint = (
        _data_fix(model, x, names, data.name, exc)
        or _known_fix(exc)
        or "make data.name/data.params produce what the model expects, or change model.params"
        + (f" (or fix {frame.name}() in {frame.filename} line {frame.lineno})" if frame else "")
    )
    return ModelError(
        f"model '{model_ref}' cannot take the dataset's {what}: {first_line(exc, 200)}"
        + (f" (in {where(frame)})" if frame else ""),
        hint=hint,
    )


def _wants_decoder_inputs(model: nn.Module, x: Any) -> bool:
    """Whether the forward failed on the probe rows ``x`` for want of ``decoder_input_ids``: it takes them, the data
    lacks them, and it runs given one start token a row. An encoder-decoder that needs them (T5) says so in its
    library's words, which name no decoder (``input_ids or inputs_embeds``)."""
    if not isinstance(x, dict) or not _lacks_decoder_inputs(model, x):
        return False
    first = tensors(x)[0]
    start = torch.zeros(rows(x), 1, dtype=torch.long, device=first.device)
    return _runs(model, {**x, "decoder_input_ids": start})


def _data_fix(model: nn.Module, x: Any, names: list[str], data_ref: str, exc: Exception) -> str | None:
    """The fix for probe rows ``x`` the forward failed on (with ``exc``) where converting some inputs makes it run:
    the data is then what to change, said as that conversion (:func:`wrong_float_inputs`, :func:`_integer_values`,
    :func:`_channels_last`, :func:`_channels_moved`); None where none does."""
    parts = tensors(x)
    off = wrong_float_inputs(model, x)
    if off is not None:
        wrong, dtype = off
        return _dtype_fix([names[i] for i in wrong], [parts[i].dtype for i in wrong], dtype, data_ref)
    ints = _integer_values(model, x)
    if ints is not None:
        wrong, dtype = ints
        return _integer_fix([names[i] for i in wrong], [parts[i] for i in wrong], dtype, data_ref)
    last = _channels_last(model, x)
    if last is not None:
        return _layout_fix(model, parts[last], names[last], data_ref)
    moved = _channels_moved(model, x, exc)
    if moved is not None:
        at, layout = moved
        return f"give input '{names[at]}' in the layout the model takes{layout} in the data function '{data_ref}'"
    return None


# A convolution's refusal of its input's channel count (``expected input[2, 8, 3, 16, 16] to have 3 channels...``)
_CHANNELS = re.compile(r"expected input\[([\d, ]+)\] to have (\d+) channels, but got (\d+) channels")


def _channels_moved(model: nn.Module, x: Any, exc: Exception) -> tuple[int, str] | None:
    """Where a convolution refused the channels of an input of ``x`` (``exc``) whose channel count lies on another
    axis (video clips as [N, T, C, H, W] to a model of [N, C, T, H, W]): its position and the permute that puts the
    channels second (:func:`~kiln.core.feeds.shape_fix`), where the forward runs once it is permuted; None
    otherwise."""
    found = _CHANNELS.search(str(exc))
    if found is None:
        return None
    shape, channels = tuple(int(d) for d in found.group(1).split(",")), int(found.group(2))
    parts = tensors(x)
    for i, t in enumerate(parts):
        if tuple(t.shape) != shape or t.ndim < 3:
            continue
        axis = next((a for a in range(2, t.ndim) if shape[a] == channels), None)
        if axis is None:
            return None
        order = (0, axis, *(a for a in range(1, t.ndim) if a != axis))  # the order shape_fix says too
        if not _runs(model, rebuild(x, [t.permute(order) if j == i else p for j, p in enumerate(parts)])):
            return None
        return i, shape_fix(shape, [None, channels, *[None] * (t.ndim - 2)], "the model", False)
    return None


def _runs(model: nn.Module, x: Any) -> bool:
    """Whether the model's forward runs on ``x`` in eval mode without an error."""
    try:
        with torch.no_grad():
            call(model.eval(), x)
    except Exception:  # noqa: BLE001 - any failure: ``x`` is not what the model takes
        return False
    return True


def _weights_dtype(model: nn.Module) -> torch.dtype | None:
    """The one dtype of the model's floating parameters; None where they have several, or there are none."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    return dtypes.pop() if len(dtypes) == 1 else None


# Integer samples (not int64, the dtype of indices) a float model reads as values, and what scales each to 0..1 or
# -1..1 as it is converted: an image's uint8 pixels (of 3 axes or more: :func:`_integer_fix`), PCM audio's samples
INTEGER_SCALES = {torch.uint8: 255, torch.int8: 128, torch.int16: 32768, torch.int32: 2**31}


def _integer_values(model: nn.Module, x: Any) -> tuple[list[int], torch.dtype] | None:
    """The positions of the integer inputs of ``x`` (:data:`INTEGER_SCALES`: an image's uint8 pixels as a decoder
    gives them, int16 PCM audio) that the model takes only as floats in its weights' dtype (a convolution's ``Input
    type (unsigned char) and bias type (float)``, ``expected scalar type Short but found Float``), with that dtype,
    where the forward runs once they are converted. None otherwise."""
    dtype, parts = _weights_dtype(model), tensors(x)
    wrong = [i for i, t in enumerate(parts) if t.dtype in INTEGER_SCALES]
    if dtype is None or not dtype.is_floating_point or not wrong:
        return None
    cast = rebuild(x, [t.to(dtype) if i in wrong else t for i, t in enumerate(parts)])
    return (wrong, dtype) if _runs(model, cast) else None


def _scale(t: torch.Tensor) -> int | None:
    """What integer input ``t`` is divided by as it is converted to floats: uint8 images (3 axes or more) by 255,
    signed samples (int16 PCM audio) by their range; None for uint8 of fewer axes (byte features, not pixels)."""
    if t.dtype == torch.uint8 and t.ndim < 3:
        return None
    return INTEGER_SCALES.get(t.dtype)


def _scaled_said(given: list[torch.Tensor]) -> str:
    """What the scales of :func:`_integer_fix` do, for the inputs ``given``: pixels to 0..1, samples to -1..1."""
    said = []
    for t in given:
        scale = _scale(t)
        if scale is not None:
            kind = str(t.dtype).removeprefix("torch.")
            values = "an image's pixels to 0..1" if t.dtype == torch.uint8 else f"{kind} samples (PCM audio) to -1..1"
            said.append(f"; / {scale} scales {values}")
    return "".join(dict.fromkeys(said))


def _integer_fix(names: list[str], given: list[torch.Tensor], dtype: torch.dtype, data_ref: str) -> str:
    """The fix for integer inputs ``names`` (tensors ``given``) the model takes as ``dtype``: uint8 images (3 axes
    or more) scaled to 0..1 as they are converted (``x.float() / 255``), as an image model's pixels are, and signed
    samples to -1..1 (``x.float() / 32768`` for int16 PCM audio)."""
    cast = ".float()" if dtype == torch.float32 else f".to({dtype})"
    how = ", ".join(
        (n if n.isidentifier() else f"input {n}") + cast + (f" / {_scale(t)}" if _scale(t) else "")
        for n, t in zip(names, given)
    )
    which = " and ".join(f"'{n}' ({str(t.dtype).removeprefix('torch.')})" for n, t in zip(names, given))
    scaled = _scaled_said(given)
    return (
        f"give input{'s' if len(names) > 1 else ''} {which} as {str(dtype).removeprefix('torch.')}, the dtype of the "
        f"model's weights ({how} in the data function '{data_ref}'{scaled})"
    )


def _channels_last(model: nn.Module, x: Any) -> int | None:
    """The position of the 4-D input of ``x`` (float, or uint8 pixels) whose last axis (1 or 3 sizes: gray or RGB)
    and not its second looks like an image's channels (NHWC), where the forward runs once it is permuted to NCHW
    (and uint8 pixels are converted to the weights' dtype, which :func:`_integer_fix` says); None otherwise."""
    parts, dtype = tensors(x), _weights_dtype(model)
    for i, t in enumerate(parts):
        pixels = t.dtype == torch.uint8 and dtype is not None
        if (t.is_floating_point() or pixels) and t.ndim == 4 and t.shape[3] in (1, 3) and t.shape[1] not in (1, 3):
            nchw = t.permute(0, 3, 1, 2).to(dtype) if pixels else t.permute(0, 3, 1, 2)
            if _runs(model, rebuild(x, [nchw if j == i else p for j, p in enumerate(parts)])):
                return i
    return None


def _layout_fix(model: nn.Module, part: torch.Tensor, name: str, data_ref: str) -> str:
    """The fix for an NHWC image input ``part`` given to a model that takes NCHW (:func:`_channels_last`): the
    permute that reorders it (:func:`~kiln.core.feeds.shape_fix`), and for uint8 pixels the conversion too."""
    shape = tuple(part.shape)
    layout = shape_fix(shape, [None, shape[3], shape[1], shape[2]], "the model", False)
    fix = f"give input '{name}' in the layout the model takes{layout}"
    dtype = _weights_dtype(model)
    if part.dtype != torch.uint8 or dtype is None:
        return f"{fix} in the data function '{data_ref}'"
    return f"{fix}; and {_integer_fix([name], [part], dtype, data_ref)}"


# Libraries' errors of a model built without a setting it needs, and the setting: no change of data helps
KNOWN_FIXES = {
    "no padding token is defined": "set pad_token_id in the model's config where the factory builds it "
    "(GPT2Config(pad_token_id=...), or model.config.pad_token_id = model.config.eos_token_id): a transformers "
    "sequence classifier finds each row's last token by it",
}


def _known_fix(exc: Exception) -> str | None:
    """The fix for a library's error whose cause is a model setting (:data:`KNOWN_FIXES`), else None."""
    text = str(exc)
    return next((fix for said, fix in KNOWN_FIXES.items() if said in text), None)


def _dtype_fix(names: list[str], given: list[torch.dtype], dtype: torch.dtype, data_ref: str) -> str:
    """The fix for float inputs ``names``, given in dtypes ``given``, that the model takes only in ``dtype`` (its
    weights'): convert them in the data function ``data_ref``, by name (``x.float()``) or by position."""
    cast = ".float()" if dtype == torch.float32 else f".to({dtype})"
    which = " and ".join(f"'{n}' ({str(d).removeprefix('torch.')})" for n, d in zip(names, given))
    how = ", ".join(n + cast if n.isidentifier() else f"{cast} on input {n}" for n in names)
    return (
        f"give input{'s' if len(names) > 1 else ''} {which} as {str(dtype).removeprefix('torch.')}, the dtype of "
        f"the model's weights ({how} in the data function '{data_ref}')"
    )


def _shown_names(model: nn.Module, x: Any) -> list[str]:
    """How an error names the inputs ``x``: a dict's keys; for a tuple or list, the forward's positional
    parameters they fill, as the export names them (their indices where the forward has fewer, or ``*args``);
    for one tensor, the forward's first parameter (``input`` where it has none)."""
    if isinstance(x, dict):
        return [str(k) for k in x]
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):  # a builtin or C++ forward: no signature to read
        params = []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    positional = [p.name for p in itertools.takewhile(lambda p: p.kind in kinds, params)]
    if isinstance(x, torch.Tensor):
        return positional[:1] or ["input"]
    return positional[: len(x)] if len(positional) >= len(x) else [str(i) for i in range(len(x))]


def wrong_float_inputs(model: nn.Module, x: Any) -> tuple[list[int], torch.dtype] | None:
    """The positions of the float inputs of ``x`` whose dtype is not that of the model's floating parameters (a
    float64 or float16 tensor against float32 weights), with that dtype, where the forward runs (in eval mode) once
    they are given in it: the inputs' dtype, not the model, is then what failed. None otherwise. Training's probe of
    the data and ``kiln export``'s of ``--input-shape`` both say a dtype fix from it."""
    dtype, parts = _weights_dtype(model), tensors(x)
    wrong = [i for i, t in enumerate(parts) if t.is_floating_point() and t.dtype != dtype]
    if dtype is None or not wrong:
        return None
    cast = rebuild(x, [t.to(dtype) if i in wrong else t for i, t in enumerate(parts)])
    return (wrong, dtype) if _runs(model, cast) else None  # failing in the weights' dtype too: not (only) the dtype


def _refuse_random_in_eval(model: nn.Module, x: Any) -> None:
    """:func:`~kiln.models.determinism.refuse_random` on the probe rows ``x`` in eval mode, the mode the export and
    every engine compute in, draws from torch's generators refused too (noise at a scale that starts at zero agrees
    from call to call only until training moves it); the model is left in training mode, as :func:`_probe`
    leaves it."""
    try:
        refuse_random(model.eval(), x, generators=True)
    finally:
        model.train()


_LOOKUPS = (nn.functional.embedding, nn.functional.embedding_bag)  # both take (input, weight, ...)
# Additions and subtractions that may shift ids by a constant before a lookup (one table, per-column offsets)
_SHIFTS = ((torch.add, 1), (torch.Tensor.add, 1), (torch.Tensor.__add__, 1), (torch.Tensor.__radd__, 1))
_SHIFTS += ((torch.sub, -1), (torch.Tensor.sub, -1), (torch.Tensor.__sub__, -1))


class EmbeddingLookups(TorchFunctionMode):
    """Inside it, every ``torch.nn.functional.embedding`` and ``embedding_bag`` call (an ``nn.Embedding``'s or
    ``nn.EmbeddingBag``'s, a subclass's, a model's own) is recorded with the index tensor it was given, that tensor's
    version counter then, and its table: what the lookup indexes, after anything the model did to its ids first (a
    bag's offsets and per-sample weights do not change which rows its ids may name). ``before``: the version counter
    of each of the ``probe`` inputs' tensors (:func:`kiln.core.data.tensors`) as the forward starts, against which an
    edit in place (``ids.masked_fill_(ids >= vocab, unk)``) shows."""

    def __init__(self, probe: Any) -> None:
        super().__init__()
        self.before = [_version(t) for t in tensors(probe)]
        self.calls: list[tuple[torch.Tensor, int | None, torch.Tensor]] = []
        self.shifts: list[Shift] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _LOOKUPS:
            ids = args[0] if args else kwargs.get("input")
            table = args[1] if len(args) > 1 else kwargs.get("weight")
            if isinstance(ids, torch.Tensor) and isinstance(table, torch.Tensor):
                self.calls.append((ids, _version(ids), table))
        out = func(*args, **kwargs)
        sign = next((sign for shift, sign in _SHIFTS if shift is func), 0)  # by identity: a func may be unhashable
        if sign and len(args) == 2 and not kwargs and _is_ids(out):
            self.shifts.extend(_shift(out, args, sign, func is torch.Tensor.__radd__))
        return out


class Shift:
    """An integer tensor ``out`` made as ``ids + offset`` (``sign`` -1: ``ids - offset``), with the version counters
    of both then: an id the data holds, shifted before its lookup (``emb(x_cat + offsets)``)."""

    def __init__(self, out: torch.Tensor, ids: torch.Tensor, offset: torch.Tensor | int, sign: int) -> None:
        self.out, self.ids, self.offset, self.sign = out, ids, offset, sign
        self.versions = (_version(out), _version(ids))


def _is_ids(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.ndim > 0 and not t.is_floating_point() and not t.is_complex()


def _shift(out: torch.Tensor, args: tuple[Any, ...], sign: int, reflected: bool) -> list[Shift]:
    """The :class:`Shift` that ``out = args[0] +/- args[1]`` may be: a side of integer ids plus an integer offset (a
    number or a tensor), each side the ids for an addition. Subtracting ids from a constant shifts no ids."""
    a, b = (args[1], args[0]) if reflected else args
    pairs = [(a, b), (b, a)] if sign > 0 else [(a, b)]
    return [Shift(out, ids, offset, sign) for ids, offset in pairs if _is_ids(ids) and _is_offset(offset)]


def _is_offset(t: Any) -> bool:
    if isinstance(t, int):
        return not isinstance(t, bool)
    return isinstance(t, torch.Tensor) and not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool


def _version(t: torch.Tensor) -> int | None:
    """``t``'s version counter, which every edit in place of it (or of a view sharing its memory) raises; None for
    an inference tensor, which keeps none (and which no forward outside inference mode can edit in place)."""
    try:
        return t._version
    except RuntimeError:
        return None


# An embedding lookup of an input's ids the data holds: the table, the columns of the input's last axis it took
# (``()``: the whole input) and the constant the model shifts them by first (None: none)
Lookup = tuple[torch.Tensor, tuple[int, ...], torch.Tensor | None]


def _tables(probe: torch.Tensor, before: int | None, lookups: EmbeddingLookups) -> list[Lookup]:
    """The embedding tables input ``probe`` was looked up in as it is, each with the columns of its last axis the
    lookup took (:func:`_columns`: ``()`` for the whole input, ``(0,)`` for LayoutLM's ``bbox[:, :, 0]``), unedited
    since the forward began at version ``before``: only then are the data's values (of those columns) that input's
    ids. An input the model maps first (``ids % vocab``, ``bbox[..., 2] - bbox[..., 0]``, or
    ``ids.masked_fill_(ids >= vocab, 0)`` in place) is looked up in none."""
    found = [(table, _columns(ids, probe)) for ids, version, table in lookups.calls if version == before]
    return [(table, columns, None) for table, columns in found if columns is not None]


def _columns(ids: torch.Tensor, probe: torch.Tensor) -> tuple[int, ...] | None:
    """The columns of ``probe``'s last axis that ``ids`` is a view of, every other axis whole and in ``probe``'s own
    memory: one selected (``bbox[:, :, 0]``) or a run of them sliced (``bbox[..., 1:3]``); ``()`` where ``ids`` is
    ``probe`` itself (or a view of its shape); None for any other tensor (a copy, a transpose, another axis cut)."""
    if ids.dtype != probe.dtype:
        return None
    if ids.data_ptr() == probe.data_ptr() and ids.shape == probe.shape:
        return ()
    lead, step = probe.ndim - 1, probe.stride(-1) if probe.ndim else 0
    offset = ids.storage_offset() - probe.storage_offset()
    base = ids.data_ptr() - offset * ids.element_size()  # the address of probe's first element, if ids is its view
    if lead < 1 or step < 1 or base != probe.data_ptr() or offset % step:
        return None
    first = offset // step
    whole_rows = tuple(ids.shape[:lead]) == tuple(probe.shape[:lead]) and ids.stride()[:lead] == probe.stride()[:lead]
    if not whole_rows or not 0 <= first < probe.shape[-1]:
        return None
    if ids.ndim == lead:
        return (first,)
    if ids.ndim == probe.ndim and ids.stride(-1) == step and first + ids.shape[-1] <= probe.shape[-1]:
        return tuple(range(first, first + ids.shape[-1]))
    return None


def _input_label(x: Any, key: Any) -> str:
    """How an error names input ``key`` of split ``x``: ``['input_ids']``, ``[1]``, or nothing for one tensor."""
    return "" if isinstance(x, torch.Tensor) else f"[{key!r}]" if isinstance(x, dict) else f"[{key}]"


def check_token_ids(model: nn.Module, data: DatasetSplits, probe: Any, lookups: EmbeddingLookups) -> None:
    """Every integer input that the probe looked up in an embedding table as it is, whole or by a column of its last
    axis (:func:`_tables`: LayoutLM's ``bbox[:, :, 0]``), holds ids within the table's rows (in those columns), in
    both splits: an id past them fails only when its batch comes, as a raw ``index out of range in self`` (after a
    whole epoch where it is a held-out row's). A float input of whole numbers that the model casts to ids
    (:func:`_cast_tables`: ``self.table(t.long())``) is checked as that cast truncates it, and ids the model shifts
    by a constant first (:func:`_shifted_tables`) as shifted. Inputs the model transforms otherwise first are not
    checked."""
    keys = list(probe) if isinstance(probe, dict) else range(len(tensors(probe)))
    names = {id(p): n.removesuffix(".weight") for n, p in model.named_parameters()}
    for key, t, before in zip(keys, tensors(probe), lookups.before):
        if not t.numel() or t.is_complex() or t.dtype == torch.bool:
            continue
        cast = t.is_floating_point()
        direct = _cast_tables(t, lookups) if cast else _tables(t, before, lookups)
        for table, columns, offset in direct + ([] if cast else _shifted_tables(model, t, before, lookups)):
            for split in ("train", "val"):
                split_x = getattr(data, f"{split}_x")
                ids = split_x[key] if isinstance(split_x, dict) else tensors(split_x)[key]
                ids = ids.long() if cast else ids
                where = f"{split}_x{_input_label(split_x, key)}"
                for k, column in enumerate(columns or (None,)):
                    if column is not None and (ids.ndim == 0 or column >= ids.shape[-1]):
                        continue  # a split of fewer columns than the probe: the model's own check says so
                    part, at = (ids, where) if column is None else (ids[..., column], f"{where}[..., {column}]")
                    shift = offset if column is None else _column_offset(offset, k)
                    name, shape = names.get(id(table), "?"), tuple(table.shape)
                    _check_ids(part, at, name, shape, data.name, column is None, shift)


def _shifted_tables(
    model: nn.Module, probe: torch.Tensor, before: int | None, lookups: EmbeddingLookups
) -> list[Lookup]:
    """The lookups of input ``probe`` (whole or its columns, as :func:`_columns` finds them) shifted by a constant
    first (``emb(x_cat + self.offsets)``: one table, an offset per column), each as ``(table, columns, offset)``;
    where the lookup took one column and dropped its axis (``x[:, 0] - 1``), the offset gets a last axis of one, so
    that the offset of each column taken runs along the last axis (:func:`_column_offset`). A constant is a number
    or a model buffer that does not vary over the rows; an offset computed from the data, or ids edited in place
    between, make no such lookup."""
    buffers = {b.untyped_storage().data_ptr() for b in model.buffers()}
    found = []
    for ids, version, table in lookups.calls:
        for shift in (s for s in lookups.shifts if s.out is ids and s.versions == (version, before)):
            columns, offset = _columns(shift.ids, probe), _constant(shift.offset, shift.ids, buffers)
            if columns is not None and offset is not None:
                offset = offset * shift.sign
                found.append((table, columns, offset if shift.ids.ndim == probe.ndim else offset.unsqueeze(-1)))
    return found


def _column_offset(offset: torch.Tensor | None, k: int) -> torch.Tensor | None:
    """The offset of the ``k``-th column a shifted lookup took (:func:`_shifted_tables`): its last axis runs along
    the columns, or is one offset for all of them."""
    return offset if offset is None or offset.ndim == 0 else offset[..., k if offset.shape[-1] > 1 else 0]


def _constant(offset: torch.Tensor | int, ids: torch.Tensor, buffers: set[int]) -> torch.Tensor | None:
    """``offset`` as a tensor when it is a constant the same for every row of ``ids``, else None."""
    if isinstance(offset, int):
        return torch.tensor(offset)
    if not offset.data_ptr() or offset.untyped_storage().data_ptr() not in buffers:
        return None
    if offset.ndim == ids.ndim and offset.shape[0] != 1:  # an offset per row: not the same for every sample
        return None
    return offset.detach().long().cpu()


def _cast_tables(probe: torch.Tensor, lookups: EmbeddingLookups) -> list[Lookup]:
    """The embedding tables that float input ``probe`` was looked up in through a cast to integers (a timestep
    ``self.table(t.long())``): lookups whose ids have ``probe``'s shape and equal ``probe.long()``, where ``probe``
    holds whole numbers only (a float that is not an id, a noise level in 0..1, is no such lookup's); ``()``: the
    whole input, as :func:`_tables` gives it."""
    if not bool(torch.isfinite(probe).all()) or not torch.equal(probe, probe.trunc()):
        return []
    ids = probe.long()

    def cast_from_probe(used: torch.Tensor) -> bool:
        return used.shape == ids.shape and not used.is_floating_point() and torch.equal(used.long(), ids)

    return [(table, (), None) for used, _, table in lookups.calls if cast_from_probe(used)]


def _check_ids(
    ids: torch.Tensor,
    where: str,
    name: str,
    shape: tuple[int, ...],
    ref: str,
    whole: bool = True,
    offset: torch.Tensor | None = None,
) -> None:
    """``ids`` (plus the ``offset`` the model shifts them by, if any) index the rows of an embedding table of
    ``shape``, or the error naming the first id outside and its row; ``whole``: ``ids`` is a whole input (token ids,
    or a shifted input whose column the error names), not a column of one (a box's x0)."""
    size = shape[0]
    moved = ids if offset is None else _shifted(ids, offset)
    if moved is None or not moved.numel() or (int(moved.min()) >= 0 and int(moved.max()) < size):
        return
    at = tuple(((moved < 0) | (moved >= size)).nonzero()[0])
    value, index = int(ids[at]), int(moved[at])
    off, shifted, token = index - value, offset is not None, whole and offset is None
    label = f"{where}[..., {int(at[-1])}]" if whole and shifted and ids.ndim > 1 else where
    side = f"past the {size} rows" if index >= size else f"below the first of the {size} rows"
    via = f"which the model shifts by {off} to id {index}, {side} of its" if shifted else f"{side} of the model's"
    larger = f"a table of at least {index + 1} rows" if shifted else f"a table of {int(ids.max()) + 1} rows"
    larger = f"a vocabulary of at least {int(ids.max()) + 1}" if token else larger
    bigger = f", or build the model with {larger}" if index >= size else ""
    keep = "keep the ids" if token else f"keep {label}"
    after = f" (the table's ids after the offset {off})" if shifted else ""
    unknown = " (map ids the vocabulary lacks to its unknown-token id)" if token else ""
    raise DataContractError(
        f"dataset '{ref}': {label} holds {'token id' if token else 'value'} {value} at row {int(at[0])}, {via} "
        f"embedding '{name}' (a table of {' x '.join(map(str, shape))}: ids 0..{size - 1})",
        hint=f"{keep} within {max(0, -off)}..{size - 1 - off}{after}{unknown}{bigger}",
    )


def _shifted(ids: torch.Tensor, offset: torch.Tensor) -> torch.Tensor | None:
    """``ids`` plus ``offset``, or None where the offset does not fit them (another length on an axis it runs
    along: a split not in the probe's layout)."""
    try:
        moved = ids.long() + offset
    except RuntimeError:
        return None
    return moved if moved.shape == ids.shape else None


def _lacks_decoder_inputs(model: nn.Module, x: Any) -> bool:
    """Whether the model's forward takes ``decoder_input_ids`` and the data does not give it: an encoder-decoder
    (BART, T5) then decodes something else than the labels (Hugging Face's: the shifted source)."""
    return "decoder_input_ids" in forward_inputs(model) and "decoder_input_ids" not in _input_names(model, x)


def _task_that_fits(ctx: StageContext[TrainSettings], model: nn.Module, data: DatasetSplits, task: Task) -> Task | None:
    """``task`` where the labels fit the model's outputs. With training skipped the val accuracy is information,
    and float labels that only a metric reads (a detector's boxes for ``validate.metric``, which this stage does not
    see) fit no default loss without being wrong: then None, said as information that claims no metric is missing.
    Class labels that do not fit the logits stay the error training gives (a head of the wrong width)."""
    try:
        check_model_fits_data(model, data, ctx.config.model.name, task, probe_rows=min(2, ctx.config.train.batch_size))
    except ModelError:
        if data.val_y is None or not data.val_y.is_floating_point():
            raise
        ctx.log.info(
            "the train stage measures no val accuracy of the untrained model: training is skipped, and the float "
            "labels %s are not class ids of its output",
            list(data.val_y.shape),
        )
        return None
    return task


def run(ctx: StageContext[TrainSettings]) -> TrainSummary:
    cfg = ctx.config
    if not torch_model_named(cfg.model):  # started from model.onnx alone: there is no PyTorch model to train
        ctx.log.info("training skipped: the run starts from model.onnx %s", cfg.model.onnx)
        return TrainSummary(status="skipped", source=cfg.model.onnx)
    if cfg.model.checkpoint or not cfg.train.enabled:
        return _skip(ctx)
    resolve_device(cfg.train)  # a device or a setting this machine cannot honour is refused before the data load
    ckpt_dir = checkpoint_dir(cfg, ctx.cache_dir)
    sources = trained_from(ctx.key_parts)
    if cfg.train.distributed.nproc_per_node > 1 and not env_from_torchrun().enabled:
        summary = TrainSummary.model_validate(run_torchrun(cfg, ctx.out, ckpt_dir, ctx.log, sources))
    else:
        summary = train_to(ctx.out, cfg, ctx.dataset(), ckpt_dir, ctx.progress, sources)
    select = cfg.train.checkpoint.select
    ctx.log.info(
        "trained %d epochs (%s on %s x%d): %s (weights of epoch %s, select: %s%s)",
        cfg.train.epochs,
        summary.precision,
        summary.device,
        summary.world_size,
        f"val accuracy {fmt(summary.val_accuracy)}"
        if summary.val_accuracy is not None
        else f"val loss {fmt(summary.val_loss)}",
        summary.selected_epoch,
        select,
        f" by {summary.best_by}" if select == "best" and summary.best_by else "",
    )
    return summary


# Held-out rows a skipped training scores its model on: the accuracy is information (the validate stage scores the
# reference on the held-out data itself), and a large model on a CPU takes seconds a batch
SKIP_SCORED_ROWS = 64


def _skipped_accuracy(
    ctx: StageContext[TrainSettings], model: nn.Module, data: DatasetSplits, task: Task
) -> float | None:
    """The val accuracy of the skipped training's model on the first :data:`SKIP_SCORED_ROWS` held-out rows."""
    assert data.val_y is not None  # a scoring task has labels
    n = min(rows(data.val_x), SKIP_SCORED_ROWS)
    ctx.log.info("val accuracy of the model as given on %d of the %d held-out rows", n, rows(data.val_x))
    with running_user_code("evaluating the untrained model on the validation data", model=True):
        x, y, cpu = take(data.val_x, slice(0, n)), data.val_y[:n], torch.device("cpu")
        return evaluate_loss_acc(model.eval(), x, y, cpu, batch=ctx.config.train.batch_size, task=task)[1]


def _skip(ctx: StageContext[TrainSettings]) -> TrainSummary:
    cfg = ctx.config
    model = build_seeded(cfg)
    data = ctx.dataset()
    probe = min(2, cfg.train.batch_size)  # rows the model takes a call: a batch-of-one model is given one
    check_model_fits_data(model, data, cfg.model.name, logits_output=cfg.signature.logits_output, probe_rows=probe)
    if cfg.train.loss is not None:
        ctx.log.info("train.loss %s not called: training is skipped, and no loss is needed", cfg.train.loss)
    with torch.no_grad():
        names = list(flatten_outputs(call(model.eval(), take(data.val_x, slice(0, probe)))))
    # Untrained here: the val accuracy is information, so a model without a logits output just has none
    scored = data.val_y is not None and logits_name(names, cfg.signature.logits_output) is not None
    with said_warnings(logging.getLogger("kiln.train")) as data_warnings:
        task = scoring_task(data, cfg.train.loss, cfg.signature.logits_output) if scored else None
    if task is not None:
        task = _task_that_fits(ctx, model, data, task)
    source = cfg.model.checkpoint or "random init"
    if cfg.model.checkpoint:
        load_weights(model, read_state_dict(Path(cfg.model.checkpoint)), cfg.model.checkpoint)
    acc = _skipped_accuracy(ctx, model, data, task) if task is not None else None
    save_trained(ctx.out, model, cfg.model, {"source": source})
    keep_trained(ctx.out, cfg.model, model)  # the export stage copies it rather than building it again
    ctx.log.info("training skipped (%s); val accuracy %s", cfg.model.checkpoint or "train.enabled: false", fmt(acc))
    return TrainSummary(status="skipped", val_accuracy=acc, source=source, data_warnings=data_warnings)
