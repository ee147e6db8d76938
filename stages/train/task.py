"""What training optimizes and measures, by the task the labels imply.

Integer labels: cross-entropy on the class-logit output (``signature.logits_output``), and accuracy; with a label
per position (token tagging ``[N, S]``, segmentation ``[N, H, W]``: :mod:`kiln.core.labels`) both average over the
labelled positions. Float 0/1 labels, one per row, of a dataset of ``num_classes=2`` beside one output column: a
binary classifier's logit, trained with binary cross-entropy on it and scored by its decision (logit above 0). Other
float targets: mean squared error on the single (or named) output, no accuracy.
``train.loss``: the user's ``(outputs, targets) -> scalar`` on the model's raw outputs; a loss taken from torch
itself (``torch.nn.functional:binary_cross_entropy_with_logits``) reads one tensor, so it is given the output the
built-in loss would read (:meth:`Task.target`). The loss is computed in FP32 on FP32 outputs.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import numbers
import os
import re
import traceback
import types
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kiln.core import labels
from kiln.core.compare import class_axis
from kiln.core.data import DatasetSplits, rows, tensors
from kiln.core.errors import ConfigError, KilnError, ModelError
from kiln.core.outputs import flatten_outputs, logits_name
from kiln.core.text import first_line
from kiln.core.user_errors import UserCodeError, out_of_memory, user_code_error
from kiln.models.registry import resolve_callable

log = logging.getLogger("kiln.train")
LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Task:
    kind: str  # "classification" | "binary" (one logit per row, float 0/1 labels) | "regression" | "custom"
    logits_output: str | int | None = None
    user_loss: LossFn | None = None
    trains: bool = True  # False: it scores a model not trained here (scoring_task), which no loss optimizes
    labels: bool = True  # False: the data has none, and train.loss is called as loss(outputs, None) (label_free)
    # what :meth:`loss` has checked of the model's output graph once, which every later step's repeats
    checked: set[str] = field(default_factory=set, init=False, compare=False, repr=False)
    # the batch at which :func:`check_task` saw class logits as wide as it (:meth:`_refuse_batch_classes` compares)
    batch_wide_at: list[int] = field(default_factory=list, init=False, compare=False, repr=False)

    def target(self, out: Any) -> torch.Tensor:
        """The output the built-in loss (and accuracy) reads."""
        outs = flatten_outputs(out)
        name = logits_name(list(outs), self.logits_output)
        if name is None:
            what = "class-logit" if self.kind == "classification" else "target"
            raise ConfigError(
                f"the model has outputs {list(outs)}; which is the {what} output of the loss?",
                hint="set signature.logits_output to its name or index, or set train.loss",
            )
        return outs[name]

    def loss(self, out: Any, y: torch.Tensor) -> torch.Tensor:
        """The mean loss over ``y``'s labelled rows or positions (``IGNORE_LABEL`` marks those without a label), or
        over the rows of float targets. train.loss's result is checked on every call (:func:`scalar_loss`), so that
        training, validation and the checks before training all refuse one that is not a scalar tensor."""
        if self.user_loss is not None:
            value = self.user_loss(self.loss_input(out), y if self.labels else None)
            return scalar_loss(self.user_loss, value, out, self.labels)
        target = self.target(out)
        check_rows(target, len(y), self.trains)
        if self.kind == "classification":
            y = y.long()  # class indices of any integer dtype (int32 from numpy, uint8): cross-entropy takes int64
            if not self.trains and not labels.are_indices(target, y):  # several targets per sample: no loss reads
                return no_loss(out, y)
            self._refuse_batch_classes(target, y, out)
            return labels.dense_cross_entropy(target.float(), y)
        if self.kind == "binary":
            self._refuse_sigmoid_once(target)
            return binary_loss(target, y)
        return nn.functional.mse_loss(target.float(), y.float())

    def _refuse_sigmoid_once(self, logit: torch.Tensor) -> None:
        """:func:`refuse_sigmoid` on the first output whose autograd graph was recorded (under ``torch.no_grad`` none
        is, and nothing can be told), not on every step: the model's graph ends in the same op at each one."""
        if "sigmoid" not in self.checked and logit.grad_fn is not None:
            refuse_sigmoid(logit)
            self.checked.add("sigmoid")

    def _refuse_batch_classes(self, target: torch.Tensor, y: torch.Tensor, out: Any) -> None:
        """Class logits as wide as the batch at the probe (:func:`check_task`) and again at a batch of another size
        follow the batch (CLIP's ``logits_per_image [images, texts]``): cross-entropy against class labels would
        train on them without error. Told at the first call whose batch differs from the probe's, before a step;
        where nothing trains, only for the output signature.logits_output names (validation refuses it too)."""
        if not self.batch_wide_at or len(y) in self.batch_wide_at or "batch classes" in self.checked:
            return
        if not self.trains and self.logits_output is None:  # nothing trains on the default output: validation warns
            return
        self.checked.add("batch classes")
        if target.ndim == 2 and target.shape[1] == len(y):
            raise batch_classes_error(_logits_output(self, out), self.logits_output is not None)

    def loss_input(self, out: Any) -> Any:
        """What train.loss is given: the model's outputs as ``forward`` returns them, the contract of a function of
        the user's; but a loss taken from torch (:func:`from_torch`) reads one tensor, so beside a dict, ModelOutput
        or tuple it gets the output the built-in loss reads (:meth:`target`): a ``transformers`` model's logits."""
        if self.user_loss is None or not from_torch(self.user_loss):
            return out
        if isinstance(out, torch.Tensor):
            refuse_probabilities(self.user_loss, out, {})
            return out
        try:
            target = self.target(out)
        except ConfigError:
            names = list(flatten_outputs(out))
            raise ConfigError(
                f"the model has outputs {names}; which of them does train.loss {loss_name(self.user_loss)} read?",
                hint="set signature.logits_output to its name or index, or wrap the loss in a function of your own "
                f"that picks it: {_wrapper(self.user_loss, _output_expr(out))}",
            ) from None
        refuse_probabilities(self.user_loss, target, flatten_outputs(out))
        return target

    def units(self, y: torch.Tensor) -> float | torch.Tensor:
        """What :meth:`loss` averages over: labelled rows or positions of class labels (a tensor on ``y``'s device),
        or rows."""
        if self.user_loss is None and self.kind == "classification":
            return labels.labelled(y)
        return float(len(y))

    def share(self, part: torch.Tensor, whole: torch.Tensor) -> float | torch.Tensor:
        """``part``'s weight in the mean over ``whole`` (a micro-batch in its batch), so that the weighted means of
        the parts add up to the mean over the whole: its share of the rows, or of the labelled positions."""
        units = self.units(whole)
        return self.units(part) / (units.clamp(min=1) if isinstance(units, torch.Tensor) else units)

    def correct(self, out: Any, y: torch.Tensor) -> tuple[float, float] | None:
        """Correctly classified rows or labelled positions, and how many were scored: accuracy's numerator and
        denominator (None: no classes to count). The count is its own, not :meth:`units`: a user loss averages
        over rows, but accuracy over labels per position counts positions. A binary classifier's row is correct
        where its logit's decision (above 0) is its 0/1 label."""
        if self.kind == "binary":
            logit = self.target(out).reshape(len(y)).float()
            return float(((logit > 0) == (y.reshape(len(y)) > 0.5)).sum().item()), float(len(y))
        if y.is_floating_point() or not self.labels:
            return None
        try:
            logits = self.target(out)
        except ConfigError:  # a user loss on a model without one logits output: no accuracy to report
            return None
        if not labels.are_indices(logits, y):  # multi-hot, packed or CTC labels beside the user's own loss
            return None
        return float(labels.hits(logits, y).item()), float(labels.labelled(y).item())


# How a model that takes one sample a call is configured (docs/byom.md): the fix where its outputs lack rows
def one_a_call_fix(trains: bool = True) -> str:
    """The fix for a model that takes one sample a call given several: it runs at batch 1, in training too where it
    trains here (``trains``), else only its engines' batch sizes are set."""
    sizes = "signature.batch_sizes: [1] and train.batch_size: 1" if trains else "signature.batch_sizes: [1]"
    return (
        "a model that takes one sample a call (a graph given as a batch of one, its forward reading x[0]) runs at "
        f"batch 1: set {sizes} (docs/byom.md); otherwise return one output row per input row (axis 0 of every "
        "output is the batch)"
    )


def check_rows(target: torch.Tensor, rows_in: int, trains: bool = True) -> None:
    """The output the built-in loss reads has one row per input row (``rows_in``, the labels' rows): each label is
    scored against its own row. A model that reads only its first row (a batch of one) and is given several returns
    fewer, which cross-entropy refuses with a shape error, or which it pairs with the wrong labels where the sizes
    happen to flatten alike, and which mean squared error broadcasts. ``trains``: False where no loss trains the
    model (validation alone scores it), which the error says instead of the loss and train.batch_size."""
    if target.ndim == 0 or len(target) >= rows_in:  # more rows: flattened positions, which check_positions says
        return
    reader = "the loss pairs" if trains else "validation pairs"
    raise ModelError(
        f"the model returns {len(target)} row{'s' if len(target) != 1 else ''} of output "
        f"{tuple(target.shape)} for {rows_in} input rows: {reader} each input row (and its label) with an "
        "output row of its own",
        hint=one_a_call_fix(trains),
    )


def from_torch(fn: LossFn) -> bool:
    """Whether train.loss is a loss of torch itself, written for one output tensor, not for a model's outputs as a
    whole: a ``torch.nn.functional`` function or torch operator (``torch:binary_cross_entropy_with_logits``), a
    ``torch.nn`` loss module (``nn.BCEWithLogitsLoss()``), or one of these with arguments bound
    (``functools.partial(F.cross_entropy, label_smoothing=0.1)``). A function the user compiled with
    ``torch.jit.script`` (module ``torch.jit``) is the user's, written for the outputs as a whole."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    if type(fn).__module__ == "torch.nn.modules.loss":
        return True
    module = getattr(fn, "__module__", None) or ""
    if isinstance(fn, types.BuiltinFunctionType):
        return module == "torch" or module.startswith(("torch._C", "torch.nn"))
    return inspect.isfunction(fn) and module == "torch.nn.functional"


# grad_fn nodes that only reshape or copy their input: a sigmoid's output stays one through them
_SHAPE_OPS = ("View", "UnsafeView", "Reshape", "Squeeze", "Unsqueeze", "Clone", "ToCopy", "Permute", "Transpose")


def takes_logits(fn: LossFn) -> bool:
    """Whether train.loss is one of torch's losses on logits, which applies the sigmoid itself:
    ``binary_cross_entropy_with_logits`` (a function, bound or not) or ``nn.BCEWithLogitsLoss``."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return type(fn).__name__ == "BCEWithLogitsLoss" or getattr(fn, "__name__", "").endswith("_with_logits")


def squashed_by(t: torch.Tensor) -> str | None:
    """The squashing function that produced ``t`` (``Sigmoid``, ``Softmax``), read off its autograd node through
    reshapes and copies; None where it is none (or no graph was recorded, under ``torch.no_grad``)."""
    node = t.grad_fn
    while node is not None:
        name = type(node).__name__.rstrip("0123456789").removesuffix("Backward")
        if name in ("Sigmoid", "Softmax"):
            return name.lower()
        if name not in _SHAPE_OPS or len(node.next_functions) < 1:
            return None
        node = node.next_functions[0][0]
    return None


def refuse_probabilities(fn: LossFn, read: torch.Tensor, outputs: Mapping[str, Any]) -> None:
    """A torch loss on logits (:func:`takes_logits`) given a sigmoid's or softmax's output (:func:`squashed_by`)
    applies a second sigmoid: it trains on values squeezed into [0.5, 0.73], its loss cannot fall below the
    prior's, and nothing fails. An error naming the output that holds the logit (the one the probabilities are the
    sigmoid of), before the first step is taken."""
    squash = squashed_by(read) if takes_logits(fn) else None
    if squash is None:
        return
    logit = next(
        (
            k
            for k, v in outputs.items()
            if isinstance(v, torch.Tensor)
            and v is not read
            and v.shape == read.shape
            and v.is_floating_point()
            and torch.allclose(torch.sigmoid(v.detach()).float(), read.detach().float(), atol=_eps(read))
        ),
        None,
    )
    where = f"output '{logit}' (the logit it is the sigmoid of)" if logit else "the output before the " + squash
    raise ConfigError(
        f"train.loss {loss_name(fn)} applies the sigmoid itself, but the output it reads is a {squash}'s (values in "
        "[0, 1]): it would train on a sigmoid of probabilities and learn next to nothing",
        hint=f"set signature.logits_output to {where}, or have the model return the logit (no final {squash})",
    )


def _eps(t: torch.Tensor) -> float:
    """A few units of ``t``'s precision (bf16 under autocast): how far two roundings of one value may lie apart."""
    return 4 * torch.finfo(t.dtype).eps


def _wrapper(fn: LossFn, read: str, targets: str = "targets") -> str:
    """A function of the user's that adapts loss ``fn`` to train.loss's call, reading the output ``read`` and the
    targets as ``targets``. Its name is never ``fn``'s own (``wrapped_<name>``): a wrapper named like the function it
    calls, pasted beside it, would shadow it and call itself forever."""
    name = getattr(fn, "__name__", "fn")
    return f"def wrapped_{name}(outputs, targets): return {name}({read}, {targets}) (named in train.loss)"


def binary_loss(logit: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Binary cross-entropy of a binary classifier's one logit per row (``[N]`` or ``[N, 1]``) against its 0/1 labels
    (the same rows, either shape); :meth:`Task.loss` refuses a sigmoid's output first (:func:`refuse_sigmoid`)."""
    rows_of = len(y)
    return nn.functional.binary_cross_entropy_with_logits(logit.float().reshape(rows_of), y.float().reshape(rows_of))


def refuse_sigmoid(logit: torch.Tensor) -> None:
    """A binary classifier's output that is a sigmoid's (:func:`squashed_by`) is refused: binary cross-entropy with
    logits applies the sigmoid itself, and would train on values squeezed into [0.5, 0.73]."""
    if squashed_by(logit) == "sigmoid":
        raise ConfigError(
            "float 0/1 labels with num_classes=2 train the model's one output column as a logit (binary "
            "cross-entropy with logits), but it is a sigmoid's output (values in [0, 1])",
            hint="return the logit (no final sigmoid), or set train.loss: torch.nn.functional:binary_cross_entropy "
            "for probabilities",
        )


def task_for(data: DatasetSplits, loss: str | None, logits_output: str | int | None) -> Task:
    """The task training optimizes: cross-entropy on integer labels, binary cross-entropy on float 0/1 labels of a
    two-class dataset (:func:`binary_task`), mean squared error on other float targets, or ``train.loss``."""
    kind = "classification" if data.classification else "regression"
    warn_label_inputs(data)
    if loss is None:
        warn_one_hot(data)
        if binary_task(data):
            return Task("binary", logits_output)
        warn_binary(data)
        return Task(kind, logits_output)
    fn = resolve_callable(loss, {}, "train.loss")
    return Task(kind, logits_output, fn)


def label_free(data: DatasetSplits, loss: str, logits_output: str | int | None) -> tuple[Task, DatasetSplits]:
    """The task of a dataset without labels trained by ``train.loss`` alone (an in-batch contrastive loss, a
    reconstruction's), and the data with a zero per row standing in for the labels, which the loader batches with the
    inputs: the loss is called as ``loss(outputs, None)``, and no accuracy is measured."""
    warn_label_inputs(data)
    fn = resolve_callable(loss, {}, "train.loss")
    placeholder = dataclasses.replace(
        data, train_y=torch.zeros(rows(data.train_x)), val_y=torch.zeros(rows(data.val_x)), num_classes=0
    )
    log.info("train.loss %s trains on the inputs alone (no labels: it is called as loss(outputs, None))", loss)
    return Task("regression", logits_output, fn, labels=False), placeholder


def no_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    """Zero: train.loss's stand-in where nothing trains (model.checkpoint, train.enabled: false). The user's loss
    is not called there, since nothing is optimized and a loss written for other outputs must not stop the run;
    accuracy reads the logits alone (:meth:`Task.correct`)."""
    return torch.zeros(())


def scoring_task(data: DatasetSplits, loss: str | None, logits_output: str | int | None) -> Task | None:
    """The task the val accuracy of a model not trained here is read by, or None where there is none to read (float
    targets beside train.loss). With train.loss, :func:`no_loss` takes its place: the checks stay those of a user
    loss (labels of its own kind are not refused), and the loss itself is never called."""
    if loss is None:  # nothing trains: the warnings of what a loss would make of the labels do not apply
        warn_label_inputs(data)
        return Task("classification" if data.classification else "regression", logits_output, trains=False)
    warn_label_inputs(data)
    return Task("classification", logits_output, no_loss) if data.classification else None


def _targets_class_axis(y: torch.Tensor) -> int:
    """The axis float targets ``y`` would hold classes on: float targets train with mean squared error on an output
    of their own shape, whose class axis is that of class logits of that rank (1 for ``[N, C]`` and
    ``[N, C, H, W]``, the last for ``[N, seq, C]``: :func:`class_axis`)."""
    return class_axis(y.ndim) % y.ndim


def _zero_one_rows(y: torch.Tensor | None, num_classes: int) -> str | None:
    """Float 0/1 labels with ``num_classes`` entries on their class axis (rows ``[N, C]``, per pixel
    ``[N, C, H, W]``, per token ``[N, seq, C]``): ``"one-hot"`` with exactly one 1 in each row or position (class
    labels one-hot encoded), ``"multi-hot"`` otherwise (multi-label targets); None for any other labels."""
    if y is None or not y.is_floating_point() or y.ndim < 2 or num_classes < 2:
        return None
    axis = _targets_class_axis(y)
    if y.shape[axis] != num_classes or not bool(((y == 0) | (y == 1)).all()):
        return None
    return "one-hot" if bool((y.sum(axis) == 1).all()) else "multi-hot"


def _zero_one_fix(kind: str, y: torch.Tensor) -> str:
    """What to do with 0/1 labels ``y`` that would train as regression targets, by their kind: one-hot labels
    become class indices by an argmax over their class axis, a row's or one per position."""
    if kind == "one-hot":
        axis = _targets_class_axis(y)
        indices = [s for i, s in enumerate(y.shape) if i != axis]
        argmax = "y.argmax(1)" if y.ndim == 2 else f"y.argmax({1 if axis == 1 else -1}) gives class indices {indices}"
        return (
            f"pass class indices ({argmax}) for cross-entropy and top-1 accuracy, or leave them as they are for "
            "regression / multi-label"
        )
    return (
        "for multi-label classification give train.loss: torch.nn.functional:binary_cross_entropy_with_logits (on "
        "the model's logits) and validate.metric: multilabel_f1, or leave them as they are "
        "for regression"
    )


def _zero_one_shape(kind: str, y: torch.Tensor) -> str:
    """How the warning describes 0/1 labels ``y`` of ``kind``: rows ``[N, C]``, or labels per position with their
    classes on axis 1 (``[N, C, H, W]``) or the last (``[N, seq, C]``)."""
    ones = "one 1" if kind == "one-hot" else "any number of 1s"
    if y.ndim == 2:
        return f"{kind} rows (0/1, {ones} per row)"
    axis = "axis 1" if _targets_class_axis(y) == 1 else "the last axis"
    return f"{kind} labels per position (0/1 on {axis}, {ones} per position)"


def warn_one_hot(data: DatasetSplits) -> None:
    """Say (once, where the task is decided) that float 0/1 labels of a dataset that declares classes train as
    regression targets: mean squared error (validation scores one-hot rows by their argmax; multi-hot ones get no
    accuracy or top-1 agreement). One-hot labels (rows, or class maps
    per pixel or per token) are told to become class indices, multi-hot ones (multi-label targets) to take a binary
    cross-entropy loss and multilabel_f1. Said, not refused: regression targets may look the same."""
    found = ((s, _zero_one_rows(getattr(data, f"{s}_y"), data.num_classes)) for s in ("train", "val"))
    split, kind = next(((s, k) for s, k in found if k is not None), (None, None))
    if split is None or kind is None:
        return
    y = getattr(data, f"{split}_y")
    # validation reads one-hot rows as the classes they encode (top-1 agreement, accuracy by their argmax)
    scored = "validation scores their argmax" if kind == "one-hot" else "with no accuracy or top-1 agreement"
    log.warning(
        "%s_y is float %s of %s with num_classes=%d: float labels train as regression targets (mean squared error), "
        "%s; %s",
        split,
        list(y.shape),
        _zero_one_shape(kind, y),
        data.num_classes,
        scored,
        _zero_one_fix(kind, y),
    )


def _binary_labels(y: torch.Tensor | None) -> bool:
    """Float labels of 0/1, one per row (``[N]`` or ``[N, 1]``): what a binary classifier (a click, a fault) is
    trained on."""
    if y is None or not y.is_floating_point() or not (y.ndim == 1 or (y.ndim == 2 and y.shape[1] == 1)):
        return False
    return bool(((y == 0) | (y == 1)).all())


def _trained_labels(data: DatasetSplits) -> tuple[str, torch.Tensor | None]:
    """The split whose labels decide the task (train's, else val's) and those labels."""
    split = "train" if data.train_y is not None else "val"
    return split, getattr(data, f"{split}_y")


def binary_task(data: DatasetSplits) -> bool:
    """Whether the labels are a binary classifier's: float 0/1, one per row, of a dataset of ``num_classes=2``. Said
    (once) as the loss it trains with, which ``train.loss`` overrides (a regression's mean squared error). The
    model's output must then be one column (:func:`check_task`): validation scores that logit's decision."""
    split, y = _trained_labels(data)
    if data.num_classes != 2 or not _binary_labels(y):
        return False
    assert y is not None
    log.info(
        "%s_y is float %s of 0/1 labels with num_classes=2: the model's one output column trains as a binary "
        "classifier's logit with binary cross-entropy (binary_cross_entropy_with_logits; no final sigmoid), and "
        "accuracy scores its decision (logit > 0); set train.loss to train with another loss",
        split,
        list(y.shape),
    )
    return True


def warn_binary(data: DatasetSplits) -> None:
    """Say (once, where the task is decided) that float 0/1 labels, one per row, train as regression targets: mean
    squared error on the single output, where a one-logit binary classifier wants a binary cross-entropy on its
    logit. Said, not refused: regression targets may look the same."""
    split = "train" if data.train_y is not None else "val"  # the labels the task is trained on decide
    y = getattr(data, f"{split}_y")
    if not _binary_labels(y):
        return
    shaped = " shaped like the logit (y.view(-1, 1) for an [N, 1] output)" if y.ndim == 1 else ""
    # with num_classes=2 already the labels train a binary classifier (binary_task), not regression
    classes = ", num_classes=2 in DatasetSplits (validation then holds its decision)"
    log.warning(
        "%s_y is float %s of 0/1 labels, one per row: float targets train with mean squared error on the model's "
        "output, with no accuracy; for a binary classifier (one logit per row) give labels%s, train.loss: "
        "torch.nn.functional:binary_cross_entropy_with_logits (on the logit, no final sigmoid)%s and "
        "validate.metric: multilabel_f1 (the positive class's F1) or a pkg.mod:fn of your own (AUC), or leave them "
        "as they are for regression",
        split,
        list(y.shape),
        shaped,
        classes,
    )


def _splits(data: DatasetSplits) -> list[tuple[str, dict[str, torch.Tensor], torch.Tensor]]:
    """Each split that has labels: its name, its inputs by name (dict key or position), its labels."""
    names = list(data.sample_shapes)
    return [
        (s, dict(zip(names, tensors(getattr(data, f"{s}_x")))), getattr(data, f"{s}_y"))
        for s in ("train", "val")
        if getattr(data, f"{s}_y") is not None
    ]


def warn_copied_input(data: DatasetSplits) -> None:
    """Say (once) that labels per position equal an input at every labelled position: the logits at position t are
    scored against the label at t, so the model learns to copy its input and scores accuracy 1.0. Hugging Face's
    causal-LM ``labels = input_ids`` is this (its model shifts them itself). Said, not refused: a copy task is one."""
    for split, inputs, y in _splits(data):
        name = labels.copied_input(inputs, y)
        if name is None:
            continue
        log.warning(
            "%s_y equals input '%s' at every labelled position: the logits at position t are scored against the "
            "label at t, so the model learns to copy its input (Hugging Face's causal-LM labels = input_ids, which "
            "its model shifts itself, are this); for next-token prediction shift them so that position t is "
            "labelled with token t+1: y[:, :-1] = %s[:, 1:] and y[:, -1] = %d (and %d on padding)",
            split,
            name,
            name,
            labels.IGNORE_LABEL,
            labels.IGNORE_LABEL,
        )
        return


def warn_labelled_padding(data: DatasetSplits) -> None:
    """Say (once) that labels per position are set where a mask input (:func:`kiln.core.labels.is_mask_name`: an
    attention or node mask's 0, a padding mask's 1) marks padding: padding that counts in the loss, accuracy and
    top-1 agreement like real tokens or nodes."""
    counts: dict[str, int] = {}
    mask = ""
    for split, inputs, y in _splits(data):
        name, count = labels.labelled_padding(inputs, y)
        if count:
            mask, counts[split] = name, count
    if not counts:
        return
    where = " and ".join(f"{n:,} positions of {s}_y" for s, n in counts.items())
    value, test = ("True or 1", "!= 0") if labels.is_padding_mask_name(mask) else ("0", "== 0")
    log.warning(
        "labels are set at %s where input '%s' is %s (padding): they count in the loss, accuracy and top-1 agreement "
        "like real positions; set those labels to %d (y[%s %s] = %d)",
        where,
        mask,
        value,
        labels.IGNORE_LABEL,
        mask,
        test,
        labels.IGNORE_LABEL,
    )


def warn_label_inputs(data: DatasetSplits) -> None:
    """Labels per position checked against the inputs beside them, before training: said once each."""
    warn_copied_input(data)
    warn_labelled_padding(data)


# F.interpolate's mode for logits with this many spatial axes (a sequence's, an image's, a volume's)
INTERPOLATE_MODES = {1: "linear", 2: "bilinear", 3: "trilinear"}


def _positions(target: torch.Tensor) -> tuple[int, ...]:
    """The shape of class logits ``target`` without its class axis: where labels per position would go."""
    axis = class_axis(target.ndim) % target.ndim
    return tuple(s for i, s in enumerate(target.shape) if i != axis)


def _channel_axis_of_one(positions: tuple[int, ...], y: torch.Tensor) -> bool:
    """Labels shaped like the logits' positions with a channel axis of size 1 after the batch (``[N, 1, D, H, W]``
    beside ``[N, C, D, H, W]`` logits: the layout of medical-imaging masks), which ``squeeze(1)`` fits."""
    return y.ndim == len(positions) + 1 and y.ndim > 2 and y.shape[1] == 1 and (y.shape[0], *y.shape[2:]) == positions


def _at_a_fraction(positions: tuple[int, ...], y: torch.Tensor) -> bool:
    """Logit positions at a whole fraction of the labels' size on every axis after the batch (a SegFormer's, at a
    quarter of the image), not the same: scaling the logits up fits them. Their axis 0 must be the labels' batch:
    time-major logits ``[T, N, C]`` (a CRNN's, for CTC) beside labels ``[N, L]`` are not a downscaled map."""
    return (
        positions != tuple(y.shape)
        and len(positions) == y.ndim
        and positions[0] == len(y)
        and all(p and s % p == 0 for p, s in zip(positions[1:], y.shape[1:]))
    )


# The fix for logits per position that do not follow the labels, where the model's forward takes decoder inputs the
# data lacks: a Hugging Face encoder-decoder given none decodes its shifted source, whose length its logits have
DECODER_FIX = (
    "give the model's decoder_input_ids, which the data lacks: the labels shifted right, starting with the decoder "
    "start token (dec[:, 0] = start, dec[:, 1:] = labels[:, :-1], the pad token where -100), and "
    "decoder_attention_mask (labels != -100); without them an encoder-decoder decodes its shifted source, whose "
    "length the logits have"
)


# Why train.loss does not take care of class logits at a fraction of the labels' size: it may scale them up to
# train (Hugging Face's SegFormer loss does), but the checks after export score the logits as the model returns them
OWN_LOSS_AT_A_FRACTION = (
    "; a train.loss that scales them up cannot stand in for this: precision and validation read accuracy and top-1 "
    "agreement off the model's logits as it returns them, one row of class scores per label"
)


def _too_few_classes(target: torch.Tensor, num_classes: int, output: str | None) -> ModelError:
    """The error for class logits per position shaped like the labels but with fewer classes than the dataset
    declares: the head's size and ``num_classes`` disagree, not the shapes."""
    count = target.shape[class_axis(target.ndim)]
    named = f"output '{output}'" if output is not None else f"the class-logit output {tuple(target.shape)}"
    return ModelError(
        f"{named} has {count} class{'es' if count != 1 else ''}, the dataset declares num_classes={num_classes}",
        hint=f"make the model's head {num_classes} classes wide (num_labels in a transformers config), or set "
        f"num_classes={count} in DatasetSplits if the labels hold {count} classes",
    )


def check_positions(
    target: torch.Tensor,
    y: torch.Tensor,
    num_classes: int,
    model_ref: str,
    lacks_decoder: bool = False,
    output: str | None = None,
    own_loss: bool = False,
) -> None:
    """Class logits ``target`` (the model's output ``output``) fit labels per position ``y``: one row of class
    scores per labelled position, which accuracy and top-1 agreement read. Logits at a fraction of the labels' size
    (a SegFormer's, at a quarter) are not scaled up by Kiln: the fix says how. ``lacks_decoder``: the model's forward
    takes ``decoder_input_ids`` the data does not give, the likely cause of logits of another length
    (:data:`DECODER_FIX`). ``own_loss``: train.loss is set, which may scale the logits up to train, but validation
    still reads them as they are (:data:`OWN_LOSS_AT_A_FRACTION`), so the fix says it cannot stand in."""
    axis = class_axis(target.ndim)
    positions = _positions(target)
    if positions == tuple(y.shape) and target.shape[axis] >= max(num_classes, 2):
        return
    if positions == tuple(y.shape) and target.shape[axis] < num_classes:  # the positions fit; the classes do not
        raise _too_few_classes(target, num_classes, output)
    if _at_a_fraction(positions, y):
        mode = INTERPOLATE_MODES.get(len(positions) - 1, "nearest")
        hint = (
            f"return the logits at the labels' size {tuple(y.shape[1:])} (a wrapper's forward: "
            f"F.interpolate(logits, size=labels' size, mode='{mode}')), or give labels at the logits' size "
            f"{positions[1:]}"
        ) + (OWN_LOSS_AT_A_FRACTION if own_loss else "")
    elif _channel_axis_of_one(positions, y):
        hint = (
            f"drop the labels' axis of size 1 (y.squeeze(1): labels {tuple(y.shape)} -> {positions}), one class "
            "index per position, as torch.nn.functional.cross_entropy takes them"
        )
    elif _shifted(positions, y) and not lacks_decoder:
        hint = SHIFTED_FIX
    else:
        hint = _misfit_hint(target, y, num_classes, lacks_decoder)
    raise ModelError(
        f"model '{model_ref}' gives class logits of shape {tuple(target.shape)} for labels of shape "
        f"{tuple(y.shape)} ({num_classes} classes): a label per position needs logits shaped like the labels plus "
        "a class axis (last, or axis 1 from four axes on)",
        hint=hint,
    )


def _misfit_hint(target: torch.Tensor, y: torch.Tensor, num_classes: int, lacks_decoder: bool) -> str:
    """The fix for class logits per position that do not follow the labels, where no one cause is known: the
    model's rows, its class count (unless it is already the dataset's), the logits output; labels of another length
    (CTC targets) or several targets per sample are a loss of the user's."""
    positions = _positions(target)
    classes = "" if target.shape[class_axis(target.ndim)] == num_classes else ", set its num_classes to the dataset's"
    hint = (
        f"make the model return one row of class logits per labelled position{classes}, or name the logits output "
        "in signature.logits_output"
    )
    if positions != tuple(y.shape):
        hint += (
            "; labels of another length than the logits' positions (CTC targets) need train.loss, a loss of "
            "yours that reads them (torch.nn.functional.ctc_loss)"
        )
    hint = f"{DECODER_FIX}; or {hint}" if lacks_decoder and positions != tuple(y.shape) else hint
    if target.ndim <= y.ndim and len(target) == len(y):  # a row of logits per sample: labels may be targets
        hint += "; labels of several targets per sample need train.loss to train on and validate.metric to score"
    return hint


def _shifted(positions: tuple[int, ...], y: torch.Tensor) -> bool:
    """Labels of a sequence one position shorter than the logits' (``[N, T-1]`` beside ``[N, T, C]``): next-token
    labels cut to ``ids[:, 1:]``, not kept as long as the input with the last position unlabelled."""
    return len(positions) == y.ndim == 2 and positions[0] == len(y) and positions[1] == y.shape[1] + 1


# The fix for next-token labels one position shorter than the logits (docs/byom.md's shift)
SHIFTED_FIX = (
    "labels one position shorter than the logits (shifted for next-token prediction?): keep them as long as the "
    f"input and mark the last position unlabelled, y[:, :-1] = ids[:, 1:] and y[:, -1] = {labels.IGNORE_LABEL} "
    f"(y = torch.nn.functional.pad(ids[:, 1:], (0, 1), value={labels.IGNORE_LABEL}))"
)


def _output_expr(out: Any) -> str:
    """How a loss reads the model's output as ``forward`` returns it: the tensor itself, a tuple's first, a dict's
    first key."""
    if isinstance(out, torch.Tensor):
        return "outputs"
    if isinstance(out, dict) and out:
        return f"outputs[{next(iter(out))!r}]"
    return "outputs[0]"


def _loss_fix(task: Task, out: Any, y: torch.Tensor, exc: BaseException) -> str:
    """The fix for a train.loss that fails on the model's outputs for two samples: where the targets ``y`` differ
    from the output it reads only in shape or dtype and the error says so (:func:`_targets_fix`), how to give them
    like it; else how it is called, and a function of the user's that adapts it, reading the output the built-in
    loss reads (``outputs['logits']``), where that is another call than the one that failed."""
    assert task.user_loss is not None
    read, pred = _read_output(task, out)
    fn = task.user_loss
    fixed = _index_column_fix(fn, read, y, exc) or _packed_targets_fix(fn, read, pred, y, exc)
    fixed = fixed or _targets_fix(fn, read, pred, y, exc)
    if fixed is not None:
        return fixed
    said = (
        "train.loss takes (outputs, targets), the model's outputs as forward returns them, and returns a scalar "
        "tensor: name a function that does"
    )
    if read == "outputs" or not _misread_outputs(exc):  # a wrapper would make the same call, or not help
        return said
    return f"{said}, or wrap this one in a function of your own: {_wrapper(task.user_loss, read)}"


def _read_output(task: Task, out: Any) -> tuple[str, Any]:
    """How a loss reads the output the built-in loss reads, and that output: the tensor itself, a dict's
    class-logit output (``outputs['logits']``, or the one ``signature.logits_output`` names; else its first), a
    tuple's first."""
    if isinstance(out, Mapping):
        try:
            name = logits_name(list(out), task.logits_output)
        except ConfigError:
            name = None
        name = name if name in out else next(iter(out), None)
        return (f"outputs[{name!r}]", out[name]) if name is not None else ("outputs", None)
    if isinstance(out, (tuple, list)):
        return "outputs[0]", out[0] if out else None
    return "outputs", out


def _misread_outputs(exc: BaseException) -> bool:
    """Whether ``exc`` is what a loss raises reading outputs of another form than it expects (a dict's key, a
    tuple's item, a tensor's attribute): the errors a wrapper passing it one output can cure. An error from torch's
    ops (RuntimeError, ValueError) says it got tensors, and a wrapper would only hide the cause."""
    return isinstance(exc, (TypeError, AttributeError, IndexError, KeyError))


# What torch's classification losses (cross_entropy, nll_loss) raise given class indices with a column axis, [N, 1]
INDEX_COLUMN = re.compile(r"0D or 1D target tensor expected|multi-target not supported")


def _index_column_fix(fn: LossFn, read: str, y: torch.Tensor, exc: BaseException) -> str | None:
    """The fix for a loss that failed on integer class labels of shape ``[N, 1]`` where torch's classification
    losses take one index a row, ``[N]``: labels ``y[:, 0]`` from the data function, or the targets squeezed in the
    call. None where that is not what failed."""
    if y.is_floating_point() or y.ndim != 2 or y.shape[1] != 1 or not INDEX_COLUMN.search(str(exc)):
        return None
    call = (
        f"name a function of your own in train.loss: {_wrapper(fn, read, 'targets.squeeze(1)')}"
        if from_torch(fn)
        else f"pass targets.squeeze(1) to the loss in {getattr(fn, '__name__', 'fn')}()"
    )
    return (
        "the labels are class indices of shape [N, 1], but torch's classification losses take "
        f"one index a row, [N]: return labels y[:, 0] from the data function, or {call}"
    )


def _packed_targets_fix(fn: LossFn, read: str, pred: Any, y: torch.Tensor, exc: BaseException) -> str | None:
    """The fix for a classification loss that failed on float targets ``[N, K]`` packing several targets a row (a
    multi-task model's class, age and attributes) beside class logits ``[N, C]`` (``pred``, read as ``read``): take
    the class column as indices, in a function of the user's. None where that is not what failed."""
    if not y.is_floating_point() or y.ndim != 2 or y.shape[1] < 2 or not INDEX_COLUMN.search(str(exc)):
        return None
    if not isinstance(pred, torch.Tensor) or pred.ndim != 2 or len(pred) != len(y):
        return None
    column = "targets[:, 0].long()"
    call = (
        f"name a function of your own in train.loss: {_wrapper(fn, read, column)}"
        if from_torch(fn)
        else f"pass {column} to the loss in {getattr(fn, '__name__', 'fn')}()"
    )
    return (
        f"the targets are floats of shape [N, {y.shape[1]}], several a row, but torch's classification losses take "
        f"one class index a row, [N]: take the column that holds the class (column 0 here, if it is that one): {call}"
    )


# What a loss raises where the targets are not shaped like the output it reads (binary_cross_entropy_with_logits'
# "Target size (...) must be the same as input size (...)", an elementwise op's "The size of tensor a ...") or not
# of its float dtype ("result type Float can't be cast to the desired output type Long", mse_loss's "Found dtype
# Long but expected Float")
SHAPE_CLASH = re.compile(r"\bsize\b|\bshape\b", re.IGNORECASE)
DTYPE_CLASH = re.compile(r"dtype|result type|can't be cast|scalar type", re.IGNORECASE)


def _targets_fix(fn: LossFn, read: str, pred: Any, y: torch.Tensor, exc: BaseException) -> str | None:
    """The fix for a loss that failed on targets holding one value per value of the float output it reads
    (``pred``, read as ``read``) but of another shape (``[N]`` beside ``[N, 1]``) or an integer dtype, where its
    error (``exc``) names a size or a dtype: labels from the data function shaped like the output and of float
    dtype, or the targets adapted in the call. None where that is not what failed."""
    if not isinstance(pred, torch.Tensor) or not pred.is_floating_point() or pred.numel() != y.numel():
        return None
    reshape, cast, said = tuple(pred.shape) != tuple(y.shape), not y.is_floating_point(), str(exc)
    if not ((reshape and SHAPE_CLASH.search(said)) or (cast and DTYPE_CLASH.search(said))):
        return None
    dims = ", ".join(["-1", *(str(d) for d in pred.shape[1:])])
    adapt = "targets" + (".float()" if cast else "") + (f".view_as({read})" if reshape else "")
    given = "y" + (".float()" if cast else "") + (f".view({dims})" if reshape else "")
    shape = "[" + ", ".join(["N", *(str(d) for d in pred.shape[1:])]) + "]"
    wants = " and ".join(
        w for w, needed in ((f"shaped like the output it reads, {shape}", reshape), ("as floats", cast)) if needed
    )
    name = getattr(fn, "__name__", "fn")
    call = (
        f"wrap it in a function of your own: {_wrapper(fn, read, adapt)}"
        if from_torch(fn)
        else f"pass {adapt} to the loss in {name}()"
    )
    return f"{loss_name(fn)} takes targets {wants}: return labels {given} from the data function, or {call}"


def scalar_loss(fn: LossFn, value: Any, out: Any, labelled: bool = True) -> torch.Tensor:
    """train.loss's result ``value`` as the scalar tensor the backward pass and the loss statistics take, or a
    ConfigError saying what it returned instead (a tuple, a Python number, a per-sample vector): a traceback from
    backward() or from the statistics otherwise. A tensor of one element (shape ``[1]``) is that element, squeezed
    to a scalar: it holds one loss as well. ``labelled``: the loss is given labels (False: it is called with
    ``targets=None``, and the fix names no loss of targets)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.reshape(())
    if isinstance(value, torch.Tensor):
        got = f"a tensor of shape {list(value.shape)}"
    elif value is None:
        got = "None"
    else:
        kind = type(value).__name__
        got = f"an {kind}" if kind[:1] in "aeiou" else f"a {kind}"
    raise ConfigError(
        f"train.loss {loss_name(fn)} returned {got}; it must return one scalar tensor",
        hint=_scalar_hint(value, out, labelled),
    )


def _scalar_hint(value: Any, out: Any, labelled: bool = True) -> str:
    """The fix for a train.loss that returned ``value``, not a scalar tensor, by what it returned: a research
    trainer's ``(loss, stats)`` needs its loss alone, a Python number (``.item()``) the tensor it came from (training
    backpropagates through it), and only a tensor of many numbers a reduction: a loss of targets with its default
    reduction only where there are targets (``labelled``; a label-free loss is given None)."""
    if isinstance(value, (tuple, list)):
        return "return only the loss tensor (e.g. loss, _ = ...; return loss): the other items are not used"
    if isinstance(value, dict) and value:
        key = "loss" if "loss" in value else next(iter(value))
        return f"return only the loss tensor (e.g. return losses[{key!r}]): the other entries are not used"
    if isinstance(value, numbers.Number):
        return (
            "return the loss tensor computed from the outputs it is given, without .item()/float(): training "
            "backpropagates through it"
        )
    if isinstance(value, torch.Tensor) and not labelled:
        return "reduce the returned tensor to one number (e.g. with .mean()): training backpropagates one scalar"
    if isinstance(value, torch.Tensor):
        return (
            "reduce a per-sample loss to one number with .mean() (or call the loss with its default reduction, "
            f"e.g. torch.nn.functional.mse_loss({_output_expr(out)}, targets)): training backpropagates one scalar"
        )
    return "return the loss as one scalar tensor computed from the outputs it is given"


def _per_row_labels(target: torch.Tensor, y: torch.Tensor, model_ref: str) -> ModelError:
    """The error for one label per row beside class logits per position (a tagger's ``[N, seq, C]``, a segmenter's
    ``[N, C, H, W]``): the class count is not what differs, the labels' kind is."""
    axis = class_axis(target.ndim) % target.ndim
    positions = ", ".join(str(s) for i, s in enumerate(target.shape) if i not in (0, axis))
    return ModelError(
        f"model '{model_ref}' gives class logits of shape {tuple(target.shape)}, one row of class scores per "
        f"position, but the labels have shape {tuple(y.shape)}, one per row",
        hint=f"give labels per position [N, {positions}] ({labels.IGNORE_LABEL} where a position has no label), "
        "or make the model pool to one row of class logits per sample [N, classes]",
    )


def _several_targets(target: torch.Tensor, y: torch.Tensor, model_ref: str) -> ModelError:
    """The error for integer labels of several columns that follow no position axis of the model (a multi-task
    model's ``[N, 2]``, a topic and a sentiment class per sample) beside one row of class logits per sample: the
    built-in cross-entropy reads one class per row, so only a loss of the user's can train on them (a model not
    trained here needs none: :func:`check_task` raises this only where the task trains)."""
    if tuple(y.shape[1:]) == (1,):
        return ModelError(
            f"model '{model_ref}' gives class logits of shape {tuple(target.shape)} for labels of shape "
            f"{tuple(y.shape)}: the built-in cross-entropy takes one class per sample, [N], not a column [N, 1]",
            hint="give the labels as [N] (y.view(-1)) from the data function",
        )
    return ModelError(
        f"model '{model_ref}' gives class logits of shape {tuple(target.shape)} for labels of shape "
        f"{tuple(y.shape)}: {y.shape[1]} targets per sample (their axis 1 follows no position axis of the model), "
        "and the built-in cross-entropy takes one class per sample",
        hint="set train.loss to a function (outputs, targets) -> scalar that reads each target against its own output "
        "(targets[:, 0], targets[:, 1]) and validate.metric to score them, or give one label per sample [N]",
    )


def batch_classes_error(output: str | None, named: bool) -> ConfigError:
    """The error for class logits whose class axis follows the batch (validation's, where it finds them): their
    argmax picks a row of the batch, which no class label names. ``named``: signature.logits_output names them."""
    said = (
        f"the class axis of output '{output}' is as long as the batch (one entry per row of it, as an "
        "[images, texts] similarity's), not classes"
    )
    return ConfigError(
        f"{said}: signature.logits_output names it as class logits" if named else f"{said}: it cannot train on labels",
        hint="name an output whose last axis holds the classes in signature.logits_output, or set train.loss to a "
        "loss of yours over the batch (a contrastive one) and score the outputs with validate.metric",
    )


def _class_count_hint(target: torch.Tensor, num_classes: int, named: bool = False) -> str:
    """The fix for class logits too few for the dataset's classes. One logit per row beside two classes is a
    binary classifier's head (a click-through model's), which trains on float 0/1 labels, not class indices.
    ``named``: signature.logits_output already names this output, so the fix is another output, not naming one."""
    if num_classes <= 2 and target.ndim in (1, 2) and target.numel() == len(target):
        shaped = "[N, 1] (y.float().view(-1, 1))" if target.ndim == 2 else "[N] (y.float())"
        return (
            f"a one-logit head is a binary classifier: give float 0/1 labels shaped like its output {shaped} with "
            "train.loss: torch.nn.functional:binary_cross_entropy_with_logits and num_classes=2 kept in DatasetSplits "
            "(validation holds its decision to top-1 agreement and accuracy), or make the model return two logits "
            "[N, 2] for the integer labels (cross-entropy)"
        )
    if named:
        return (
            "name an output whose last axis holds the dataset's classes in signature.logits_output, or give the model "
            "as many class logits as the dataset has classes (its num_classes; num_labels in a transformers config)"
        )
    return (
        "give the model as many class logits as the dataset has classes (its num_classes; num_labels in a "
        "transformers config), or name the logits output in signature.logits_output"
    )


def loss_name(fn: LossFn) -> str:
    """train.loss's function as the config names it: ``'package.module:function'``."""
    return f"'{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', fn)}'"


def bce_autocast_fix(exc: BaseException) -> str | None:
    """The fix for a dtype clash under autocast raised in torch's binary_cross_entropy (named as train.loss, or
    called by the user's loss): it takes probabilities, which autocast leaves in bf16/fp16 beside float32 targets,
    and torch counts it unsafe under autocast (a sigmoid's output in half precision rounds to 0 or 1). The form on
    logits is safe."""
    bce = os.path.join("torch", "nn", "functional.py")
    frames = traceback.extract_tb(exc.__traceback__)
    if not any(f.name == "binary_cross_entropy" and f.filename.endswith(bce) for f in frames):
        return None
    return (
        "binary_cross_entropy on probabilities is unsafe under autocast: set train.loss: "
        "torch.nn.functional:binary_cross_entropy_with_logits and have the model return the logit (no final "
        "sigmoid), or train without autocast (train.precision: fp32)"
    )


def loss_error(task: Task, exc: BaseException, doing: str, hint: str | None = None) -> UserCodeError | None:
    """``exc``, raised by train.loss, as one error naming the function: in the user's file it names the line
    too; a library's function named directly (``torch.nn.functional:binary_cross_entropy``) has no line of the
    user's. None for the built-in loss and for errors with a meaning of their own (Kiln's, out of memory)."""
    fn = task.user_loss
    if fn is None or isinstance(exc, KilnError) or out_of_memory(exc):
        return None
    what = f"loss function {loss_name(fn)}"
    err = user_code_error(exc, doing, what, hint)
    if err is not None:
        return err
    fix = hint or (
        "train.loss is called as function(outputs, targets) on the model's raw outputs: name a function that takes "
        "them, or wrap this one in a function of your own"
    )
    return UserCodeError(
        f"{what} raised {type(exc).__name__}: {first_line(exc)} while {doing}",
        hint=f"{fix} (--verbose shows the traceback)",
        detail="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
    )


@contextmanager
def loss_errors(
    task: Task,
    doing: str | Callable[[], str],
    hint: str | Callable[[BaseException], str | None] | None = None,
) -> Iterator[None]:
    """Around a call of train.loss: an exception it raises becomes :func:`loss_error`'s error, never a traceback.
    ``doing`` (or a callable giving it at the time) says what Kiln was at; ``hint`` (or a callable giving one for
    the exception) a fix."""
    try:
        yield
    except Exception as exc:
        err = loss_error(task, exc, doing() if callable(doing) else doing, hint(exc) if callable(hint) else hint)
        if err is None:
            raise
        raise err from exc


def _say_unscored(task: Task, target: torch.Tensor, y: torch.Tensor) -> None:
    """Say (once, before training) that labels per position of another length than the class logits' positions
    (CTC or sequence-to-sequence targets) are the user's loss's to read: no label pairs with a row of logits, so
    training reports no accuracy and ranks epochs by validation loss."""
    assert task.user_loss is not None
    log.info(
        "labels of shape %s do not follow the positions of class logits %s: train.loss %s reads them, and training "
        "reports no accuracy (epochs are ranked by validation loss)",
        list(y.shape[1:]),
        list(target.shape[1:]),
        loss_name(task.user_loss),
    )


def _unscored(target: torch.Tensor, y: torch.Tensor) -> bool:
    """Labels per position that follow neither the class logits' positions nor a fraction of them (CTC or
    sequence-to-sequence targets of another length): no label pairs with a row of logits, so none is scored."""
    positions = _positions(target)
    return positions != tuple(y.shape) and not _at_a_fraction(positions, y)


def _say_unscored_untrained(target: torch.Tensor, y: torch.Tensor, output: str | None) -> None:
    """Warn (once, where training is skipped) that labels per position which do not follow the class logits'
    positions are not scored: nothing trains, so no loss needs them, and the val accuracy is not measured (as the
    validate stage says of them). Said, not refused: a CTC model's labels are of their own length."""
    named = f"'{output}' " if output is not None else ""
    log.warning(
        "labels %s do not follow the positions of class logits %s%s (they take labels %s): training is skipped "
        "and no loss reads them, so no val accuracy is measured",
        _shape(tuple(y.shape), len(y)),
        named,
        _shape(tuple(target.shape), len(y)),
        _shape(_positions(target), len(y)),
    )


def _shape(shape: tuple[int, ...], rows: int) -> str:
    """A shape for a message, its axis 0 written N where it is the batch of ``rows`` probed: ``[N, 32, 11]``."""
    return "[" + ", ".join("N" if i == 0 and d == rows else str(d) for i, d in enumerate(shape)) + "]"


def _logits_output(task: Task, out: Any) -> str | None:
    """The name of the output the built-in loss reads, for messages; None where no one output is it."""
    try:
        return logits_name(list(flatten_outputs(out)), task.logits_output)
    except ConfigError:
        return None


def _check_zero_one_targets(task: Task, out: Any, y: torch.Tensor, num_classes: int) -> None:
    """0/1 targets shaped like the class-logit output (a multi-label head's ``[N, K]``) must be float, which is what
    marks them as multi-label decisions beside validation's agreement gate and ``multilabel_f1``, and as wide as the
    dataset's ``num_classes``, or the gate on each label's decision is not applied. Said before training, where
    integer ones fail only after it (validation reads integer labels as class indices, one per row)."""
    if y.ndim < 2 or not bool(((y == 0) | (y == 1)).all()) or not bool((y == 1).any()):  # all 0: nothing to tell
        return
    try:
        target = task.target(out)
    except ConfigError:  # no one class-logit output: nothing for the targets to be shaped like
        return
    axis = _targets_class_axis(y)
    if tuple(target.shape) != tuple(y.shape) or y.shape[axis] < 2:
        return
    if not y.is_floating_point():
        argmax = "y.argmax(1)" if axis == 1 else "y.argmax(-1)"
        raise ConfigError(
            f"the labels are integer 0/1 {list(y.shape)}, shaped like the class-logit output {list(target.shape)}: "
            "integer labels are class indices, one per row (or position), not a 0/1 entry per class",
            hint="multi-label targets: cast them to float (y.float()) in the data function, with train.loss: "
            "torch.nn.functional:binary_cross_entropy_with_logits and validate.metric: multilabel_f1; one-hot class "
            f"labels: pass class indices ({argmax})",
        )
    if num_classes > 0 and y.shape[axis] != num_classes:
        raise ConfigError(
            f"the 0/1 targets {list(y.shape)} hold {y.shape[axis]} labels per row, the dataset declares "
            f"num_classes={num_classes}: validation holds each label's decision to agreement only where they are "
            "the same number",
            hint=f"set num_classes={y.shape[axis]} (the label width) in DatasetSplits",
        )


def check_task(
    task: Task,
    out: Any,
    y: torch.Tensor,
    num_classes: int,
    model_ref: str,
    lacks_decoder: bool = False,
    sizes: tuple[int, ...] = (),
) -> None:
    """The model's output on two samples fits the task: a clear error before training, not a traceback in it.
    ``lacks_decoder``: the model takes decoder inputs the data does not give (:func:`check_positions`); ``sizes``:
    the inputs' sizes past their batch axis, which labels per position follow
    (:func:`~kiln.core.labels.follows_positions`)."""
    _check_zero_one_targets(task, out, y, num_classes)
    if task.user_loss is not None:
        doing = "trying train.loss on the model's outputs for two samples"
        with loss_errors(task, doing, lambda exc: _loss_fix(task, out, y, exc)):
            value = task.loss(out, y)  # refuses a result that is not one scalar tensor (scalar_loss)
        _refuse_nonfinite_loss(task, value, out, y)
        if not (task.kind == "classification" and labels.per_position(y)):
            return
        try:  # labels per position: accuracy and top-1 read them off the class-logit output, whatever the loss
            target = task.target(out)
        except ConfigError:  # no one class-logit output: validation compares the outputs by agreement
            return
        if target.ndim != y.ndim + 1:  # labels of another kind beside the user's loss (multi-hot): none read
            return
        if _positions(target) == tuple(y.shape) or _at_a_fraction(_positions(target), y):
            check_positions(target, y, num_classes, model_ref, output=_logits_output(task, out), own_loss=True)
        else:
            _say_unscored(task, target, y)
        return
    target = task.target(out)
    check_rows(target, len(y), task.trains)
    if task.kind == "binary":
        _check_one_logit(target, y, model_ref)
    elif task.kind == "classification" and labels.follows_positions(y, target, flatten_outputs(out).values(), sizes):
        if not task.trains and not lacks_decoder and _unscored(target, y):
            _say_unscored_untrained(target, y, _logits_output(task, out))
            return
        check_positions(target, y, num_classes, model_ref, lacks_decoder, _logits_output(task, out))
    elif task.kind == "classification" and labels.per_position(y):  # targets per sample: no class count to check
        if task.trains:
            raise _several_targets(target, y, model_ref)
    elif task.kind == "classification":
        if target.ndim > 2 and y.ndim == 1:
            raise _per_row_labels(target, y, model_ref)
        _check_class_count(task, target, len(y), num_classes, model_ref)
    elif tuple(target.shape) != tuple(y.shape):
        # float labels of a classifier (the data declares classes, the output has a row of scores per label)
        classes = num_classes > 0 and target.ndim == y.ndim + 1 and _positions(target) == tuple(y.shape)
        raise ModelError(
            f"model '{model_ref}' gives {tuple(target.shape)} for float targets of shape "
            f"{tuple(y.shape)}: mean squared error needs the same shape",
            hint="give class labels as integers (y.long()): float labels are regression targets"
            if classes
            else "make the targets match the output, name the output in signature.logits_output, or set train.loss",
        )


def _refuse_nonfinite_loss(task: Task, value: torch.Tensor, out: Any, y: torch.Tensor) -> None:
    """train.loss returning NaN or infinity for finite outputs of the model on two samples is the loss's doing: every
    training step would be skipped as non-finite, and the run would end blaming the learning rate. Not refused where
    the targets are not finite themselves or mark ignored entries (a mean over no labelled entry is NaN), as those
    two samples alone may be."""
    assert task.user_loss is not None
    if bool(torch.isfinite(value).all()) or not _all_finite(flatten_outputs(out).values()):
        return
    if y.is_floating_point() and not bool(torch.isfinite(y).all()):
        return
    if not y.is_floating_point() and bool((y == labels.IGNORE_LABEL).any()):
        return
    raise ConfigError(
        f"train.loss {loss_name(task.user_loss)} returns {value.item()} for the model's outputs on two samples, "
        "which are finite: every training step would be skipped as non-finite",
        hint=f"make {loss_name(task.user_loss)} return a finite loss for finite outputs (guard divisions by zero, "
        "log(0), a mean over no entries)",
    )


def _all_finite(tensors: Any) -> bool:
    """Whether every floating-point tensor of ``tensors`` holds finite values only (integer ones always do)."""
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())


def _check_class_count(task: Task, target: torch.Tensor, batch: int, num_classes: int, model_ref: str) -> None:
    """Class logits of one row per sample hold at least the dataset's classes. Where they are as wide as the probe's
    ``batch``, the task records it: the first training batch of another size tells whether they follow the batch
    (:meth:`Task._refuse_batch_classes`), which this probe alone cannot tell from as many classes."""
    wide = target.ndim == 2 and target.shape[1] == batch
    if wide and batch not in task.batch_wide_at:
        task.batch_wide_at.append(batch)
    if target.ndim == 2 and target.shape[1] >= max(num_classes, 2):
        return
    follows = ": its class axis is as long as the batch (an [images, texts] similarity's would be)" if wide else ""
    raise ModelError(
        f"model '{model_ref}' gives class logits of shape {tuple(target.shape)} for a batch of {batch}, but the "
        f"dataset has {num_classes} classes{follows}",
        hint=_class_count_hint(target, num_classes, task.logits_output is not None),
    )


def _check_one_logit(target: torch.Tensor, y: torch.Tensor, model_ref: str) -> None:
    """A binary classifier's output is one logit per row (``[N]`` or ``[N, 1]``), which its float 0/1 labels train
    with binary cross-entropy; a head of two or more columns takes class indices (cross-entropy) instead."""
    if target.ndim in (1, 2) and target.numel() == len(y):
        return
    raise ModelError(
        f"model '{model_ref}' gives {tuple(target.shape)} for float 0/1 labels of shape {tuple(y.shape)} with "
        "num_classes=2: a binary classifier's binary cross-entropy reads one logit per row ([N, 1] or [N])",
        hint="for a head of two class logits give class indices (y.long().view(-1)): cross-entropy; or return one "
        "logit per row, or set train.loss",
    )


def check_trainable(model: nn.Module) -> None:
    """A model none of whose parameters requires grad has nothing to train: an error before the first step, where
    the backward pass would fail with a traceback."""
    if any(p.requires_grad for p in model.parameters()):
        return
    count = sum(1 for _ in model.parameters())
    raise ModelError(
        f"no parameter of the model requires grad (all {count} are frozen): there is nothing to train"
        if count
        else "the model has no parameters: there is nothing to train",
        hint="unfreeze what should train (requires_grad_(True)) in the model's code, or set train.enabled: false "
        "to take the model as it is",
    )


def check_loss_has_grad(task: Task, loss: torch.Tensor) -> None:
    """The loss of a micro-batch must depend on the model's trainable parameters, or there is nothing to
    backpropagate: a detached user loss, or a model whose forward detaches its outputs (torch.no_grad())."""
    if loss.requires_grad:
        return
    fn = task.user_loss
    if fn is not None:
        raise ConfigError(
            f"train.loss {loss_name(fn)} returned a tensor that does not depend on the model's parameters (it has no "
            "gradient): it was detached, rebuilt from a Python number, or computed under torch.no_grad()",
            hint="return the loss computed from the outputs it is given, without .detach(), .item()/float() or "
            "torch.no_grad()",
        )
    raise ModelError(
        "the model's outputs do not depend on its trainable parameters: the loss has no gradient",
        hint="remove .detach() or torch.no_grad() from the model's forward, where it covers the trained layers",
    )
