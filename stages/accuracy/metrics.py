"""The user's metric (``validate.metric``): the number their task is judged by, on the held-out split, for the
baseline and every engine, gated by its drop (``validate.gates.max_metric_drop``, per precision).

Tensor cosine and top-1 agreement are proxies; users state accuracy budgets as a drop in their own metric (as
NNCF's accuracy-aware quantization and Olive's metric goals do). A metric is ``fn(outputs, labels) -> float``:
``outputs`` the model's outputs by name (graph order), ``labels`` the held-out ``val_y`` as a numpy array. Higher
is better unless the function says otherwise (an attribute ``higher_is_better = False``) or the config does. Where
the data has no labels, a user's metric scores the outputs against the reference's (:func:`against_reference`):
a generator's images have no labels, and its quality against PyTorch's (PSNR, the share of pixels close to them)
is the number its user judges an engine by. A function with an attribute ``versus_reference = True`` is scored so
where the data has labels too: a CTC model's labels are what training needs, yet its user asks whether an engine
decodes the transcript PyTorch decodes, which a metric against the labels does not say.

The drop is in the metric's own units (a share in [0, 1]: 0.01 is one point), except for an error metric, whose
units are the targets' (MSE's are their square: targets in the thousands give an MSE in the millions, where any
fixed allowance is rounding noise or none at all): there it is the rise over the targets' spread in the metric's
units (:func:`scaled_by`: an MSE's over their variance, R^2 points; over the reference's own value where that is
larger, a reference worse than the targets' mean), else over the reference's value,
``(value - reference) / reference`` (0.01: 1 % more error). The built-in error metrics are relative; a user's
metric is when its function says so (an attribute ``relative = True``).

Built-ins, for what users ask most (each reads the class-logit output, ``signature.logits_output``, where it
needs one): ``accuracy``, ``macro_f1``, ``multilabel_f1`` (0/1 targets shaped like the logits), ``token_accuracy``
(labels per position, padding excluded), the error metrics of predicted values ``mse``, ``rmse``, ``mae`` and
``smape`` (lower is better, relative), and ``detection_recall`` (box-and-class heads, below). Float targets (a
regression's, a forecaster's) are scored by ``mse`` where no metric is set (:func:`default_metric`).
"""

from __future__ import annotations

import inspect
import re
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import numpy as np

from kiln.core.compare import class_axis
from kiln.core.errors import ConfigError, KilnError, ModelError
from kiln.core.labels import IGNORE_LABEL, are_indices, per_position
from kiln.core.labels import accuracy as label_accuracy
from kiln.core.output_names import BOX_NAMES, SCORE_NAMES
from kiln.models.registry import resolve_callable

# what a metric scores the outputs against: the held-out labels, or the reference's outputs by name (no labels)
Labels = np.ndarray | dict[str, np.ndarray]
MetricFn = Callable[[dict[str, np.ndarray], Labels], float]
IOU = 0.5  # detection_recall: a label box is found by a prediction of its class overlapping it this much
# detection_recall's boxes: what a reference that scores 0 is most often given instead (said where it is warned of)
BOX_FORMAT = (
    "boxes must be (x1, y1, x2, y2) in the labels' units; transformers' detectors give (cx, cy, w, h), normalised: "
    "convert them in a wrapper"
)


@dataclass(frozen=True)
class Metric:
    """A resolved metric: its name (as configured), function and direction; ``relative``: its drop is relative to
    the reference's value (an error metric's, in the targets' units); ``default``: no one configured it, it is the
    one float targets get (:func:`default_metric`); ``versus_reference``: its labels are the reference's outputs,
    the data having none (:func:`against_reference`) or the function asking for them (:func:`resolve_metric`)."""

    name: str
    fn: MetricFn
    higher_is_better: bool = True
    relative: bool = False
    default: bool = False
    scale: float | None = None  # what a relative drop is over: the targets' spread in the metric's units (scaled_by)
    versus_reference: bool = False
    threshold: float | None = None  # multilabel_f1's decision threshold, read off the reference (decided_by)

    def __call__(self, outputs: dict[str, np.ndarray], labels: Labels) -> float:
        """The metric of ``outputs``; the user's function failing is their error, named with what Kiln was doing."""
        try:
            held = {} if self.threshold is None else {"threshold": self.threshold}
            returned = self.fn(outputs, labels, **held)
        except KilnError:  # a built-in's own error, with its own fix
            raise
        except Exception as exc:  # the user's function (or a built-in on outputs it does not fit): one line
            if self.name in BUILTINS:  # Kiln's own: what it takes, not where in Kiln it raised
                raise ModelError(
                    f"validate.metric '{self.name}' does not fit outputs {_shapes(outputs)} and "
                    f"{_labels_said(labels)}: {exc}",
                    hint=_misfit_hint(self.name, exc),
                ) from None
            frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename != __file__]
            at = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else _defined_at(self.fn)  # the user's line
            raise ModelError(
                f"validate.metric '{self.name}'{at} failed on outputs {_shapes(outputs)} and "
                f"{_labels_said(labels)}: {type(exc).__name__}: {exc}",
                hint=f"the metric takes (outputs: dict of name -> array, labels: {_labels_kind(labels)}) and returns "
                "a float",
            ) from None
        value = _as_float(returned, self.name)
        if not np.isfinite(value):
            said = " against the reference's outputs" if self.versus_reference else ""
            raise ModelError(
                f"validate.metric '{self.name}' returned {value} on outputs {_shapes(outputs)}{said}",
                hint="return a finite float (e.g. guard divisions by zero)"
                + ("; the reference scores itself too, a perfect match: cap it (a PSNR at 100 dB)" if said else ""),
            )
        return value

    def drop(self, baseline: float, value: float) -> float:
        """How much worse ``value`` is than ``baseline`` (positive: worse), whichever way the metric points: in its
        own units, or for a :attr:`relative` one over :attr:`scale`, the targets' spread (an MSE's rise over their
        variance: R^2 points), else over the baseline's magnitude. Not over the baseline alone where the targets
        give a scale: a reference that fits its targets closely has a small error, and any engine's noise would be
        many times it. Over the baseline where it exceeds the spread (:meth:`worse_than_mean`): an engine's rounding
        of predictions far from the targets moves their error by more than the spread, which would then fail any
        engine. With neither (targets that do not vary, a perfect fit) the drop is in its own units."""
        worse = baseline - value if self.higher_is_better else value - baseline
        over = max(self.scale or 0.0, abs(baseline)) if self.relative else 0.0
        return worse / over if over else worse

    def worse_than_mean(self, baseline: float | None) -> bool:
        """Whether a reference scoring ``baseline`` errs more than the targets spread (an MSE over their variance:
        R^2 < 0), i.e. more than predicting their mean would: its drop is then over its own value (:meth:`drop`)."""
        return bool(self.relative and self.scale and baseline is not None and abs(baseline) > self.scale)


def against_reference(metric: Metric) -> Metric:
    """``metric`` where the data has no labels: a user's function scores each candidate's outputs against the
    reference's, which it gets as its labels (a dict by name, as ``outputs``); the reference scores itself, a
    perfect match, as the baseline the drop is measured from. A built-in reads labels of a task (classes, targets,
    boxes) that the reference's outputs are not: a ModelError naming both fixes."""
    if metric.name in BUILTINS:
        raise ModelError(
            f"validate.metric '{metric.name}' needs labels, and the data has none (val_y is None)",
            hint="return held-out labels from the data function, or give a metric of your own (pkg.mod:fn): "
            "without labels it scores each engine's outputs against the reference's (its labels)",
        )
    return replace(metric, versus_reference=True)


def _labels_said(labels: Labels) -> str:
    """The labels as an error names them: their dtype and shape, or the reference's outputs and their shapes."""
    if isinstance(labels, dict):
        return f"the reference's outputs {_shapes(labels)} (its labels: the data has none, or versus_reference)"
    return f"labels {labels.dtype}{list(labels.shape)}"


def _labels_kind(labels: Labels) -> str:
    return "dict of name -> the reference's array" if isinstance(labels, dict) else "array"


def decided_by(metric: Metric | None, reference: dict[str, np.ndarray]) -> Metric | None:
    """``metric`` with the decision threshold of ``multilabel_f1`` read once off the reference's outputs
    (``reference``, at the scored point): 0.5 for probabilities, 0 for logits (:func:`decision_threshold`). Read off
    each engine's own scores, one value strayed below 0 would move an engine from 0.5 to 0 and score it by another
    decision than the reference and the agreement gate use. Other metrics as they are."""
    if metric is None or metric.name != "multilabel_f1" or not hasattr(metric.fn, "logits") or not reference:
        return metric
    logits = metric.fn.logits  # type: ignore[attr-defined]  # set by _on_logits
    return replace(metric, threshold=decision_threshold(_pick(reference, logits)))


def scaled_by(metric: Metric | None, targets: np.ndarray | None) -> Metric | None:
    """``metric`` with the scale its relative drop is over (:meth:`Metric.drop`): for ``mse`` the targets'
    variance, ``rmse`` their standard deviation, ``mae`` their mean absolute deviation; others as they are."""
    if metric is None or not metric.relative or targets is None or metric.name not in SPREADS:
        return metric
    y = np.asarray(targets, dtype=np.float64)
    y = y[np.isfinite(y)]
    scale = float(SPREADS[metric.name](y - y.mean())) if y.size > 1 else 0.0
    return replace(metric, scale=scale) if scale > 0 else metric


def _as_float(returned: object, name: str) -> float:
    """A metric's value as a float: a number, or an array or tensor of one element. None is said as such (NumPy
    would read it as NaN): a function without a return statement returns it."""
    if returned is None:
        raise ModelError(
            f"validate.metric '{name}' returned None (a function without a return statement?), not a float",
            hint="return the score as one float (e.g. return float(scores.mean()))",
        )
    try:  # a str of a number converts, yet is no score: refused with the rest
        value = None if _is_text(returned) else np.asarray(returned, dtype=np.float64)
    except (TypeError, ValueError, RuntimeError):  # a dict, a tensor that needs grad
        value = None
    if value is None or value.size != 1:
        shape = getattr(returned, "shape", None)
        what = f"an array of shape {tuple(shape)}" if shape is not None else type(returned).__name__
        raise ModelError(
            f"validate.metric '{name}' returned {what}, not a float",
            hint="return one float for the whole set (e.g. a mean over the samples: float(scores.mean()))",
        )
    return float(value.reshape(()))


def _is_text(value: object) -> bool:
    """A str or bytes, or an array of them: text, which NumPy would read as a number where it spells one."""
    return isinstance(value, (str, bytes)) or getattr(getattr(value, "dtype", None), "kind", "") in ("U", "S")


def resolve_metric(
    ref: str | None, logits: str | None, higher_is_better: bool | None = None, num_classes: int = 0
) -> Metric | None:
    """``validate.metric``: a built-in name or ``pkg.mod:fn`` (imported here; a bad path is a ConfigError).
    ``num_classes``: the data's (0: not declared), which tells ``detection_recall`` a DETR-style head's scores, one
    class wider (:func:`_class_decisions`). A function's attributes say its direction (``higher_is_better``), its
    drop's unit (``relative``) and what it scores against (``versus_reference``: the reference's outputs, even where
    the data has labels); a built-in's are Kiln's (each reads labels of a task)."""
    if ref is None:
        return None
    if ref in BUILTINS:
        fn, higher = BUILTINS[ref]
        if ref in TAKES_CLASSES:
            fn = partial(fn, num_classes=num_classes)
        if higher_is_better is not None:
            higher = higher_is_better
        return Metric(ref, _on_logits(fn, logits, ref), higher, ref in RELATIVE)
    fn = resolve_callable(ref, {}, "validate.metric")
    _refuse_misfit_call(fn, ref)
    default = bool(getattr(fn, "higher_is_better", True))
    relative = bool(getattr(fn, "relative", False))
    versus = bool(getattr(fn, "versus_reference", False))
    higher = default if higher_is_better is None else higher_is_better
    return Metric(ref, fn, higher, relative, versus_reference=versus)


def check_metric(settings: Any) -> None:
    """The stage check (:attr:`kiln.core.stage.Stage.checks`) of a stage that scores ``settings.validate.metric``:
    a built-in name, or a function that imports and takes ``(outputs, labels)``."""
    resolve_metric(settings.validate.metric, None)


def _refuse_misfit_call(fn: Callable[..., Any], ref: str) -> None:
    """A ConfigError where ``fn`` cannot be called as ``fn(outputs, labels)`` (another number of parameters, a
    keyword-only one without a default): said before any output is scored. A callable whose signature Python cannot
    read (a C function) is left to its first call."""
    try:  # the callable's own parameters: a decorator's wrapper (functools.wraps) may fill in the wrapped ones
        inspect.signature(fn, follow_wrapped=False).bind({}, None)
    except ValueError:
        return
    except TypeError as exc:
        raise ConfigError(
            f"validate.metric '{ref}'{_defined_at(fn)} cannot be called as fn(outputs, labels): {exc}",
            hint="the metric takes (outputs: dict of name -> array, labels: array) and returns a float",
        ) from None


def _defined_at(fn: Callable[..., Any]) -> str:
    """`` (file:line)`` where ``fn`` is defined; empty where Python does not know."""
    code = getattr(inspect.unwrap(fn), "__code__", None)
    return f" ({code.co_filename}:{code.co_firstlineno})" if code is not None else ""


def default_metric(outputs: dict[str, np.ndarray], targets: np.ndarray, logits: str | None) -> Metric | None:
    """The metric float targets (a regression's, a forecaster's: the caller tells them from class scores) are
    judged by where ``validate.metric`` is unset: ``mse``, relative, on the output :func:`prediction_candidates`
    finds alone, as ``mse`` itself would. None where targets are 0/1 (multi-label's, which ``multilabel_f1``
    scores), no single output is the prediction (several fit, none named; none fits: naming one is the user's
    setting, not worth an error where they asked for no metric), or a value is not finite (a series' missing
    values), which would make it an error of a metric no one set."""
    if not np.issubdtype(targets.dtype, np.floating) or np.isin(targets, (0, 1)).all():
        return None
    fit = prediction_candidates(outputs, targets, logits)
    if len(fit) != 1 or np.size(outputs[fit[0]]) != targets.size:
        return None
    if not (np.isfinite(targets).all() and np.isfinite(outputs[fit[0]]).all()):
        return None
    return Metric(DEFAULT, _on_logits(_mse, logits, DEFAULT), higher_is_better=False, relative=True, default=True)


def _on_logits(fn: Callable[..., float], logits: str | None, name: str) -> MetricFn:
    def metric(outputs: dict[str, np.ndarray], labels: np.ndarray, **held: float) -> float:
        return fn(outputs, labels, logits, **held)

    metric.logits = logits  # type: ignore[attr-defined]  # the output it reads, for decided_by

    metric.__name__ = name
    return metric


def _pick(outputs: dict[str, np.ndarray], logits: str | None) -> np.ndarray:
    if logits is not None and logits in outputs:
        return outputs[logits]
    return next(iter(outputs.values()))


def _indices(out: np.ndarray, labels: np.ndarray, name: str) -> np.ndarray:
    """``labels`` as class indices of the logits ``out``, or a ValueError saying what the metric takes."""
    y = labels.astype(np.int64) if np.all(np.mod(labels, 1) == 0) else labels
    if not are_indices(out, y):
        raise ValueError(
            f"{name} takes class indices, one per row or position of logits {list(out.shape)}; these labels are "
            f"{labels.dtype}{list(labels.shape)}" + (f" ({_kind(labels)})" if labels.shape == out.shape else "")
        )
    return y


def _kind(labels: np.ndarray) -> str:
    """The metric for labels shaped like the outputs: 0/1 targets are multi-label's, other values a regression's
    (a denoiser's noise)."""
    return "multi-label: multilabel_f1" if np.isin(labels, (0, 1)).all() else "regression targets: mse"


def _accuracy(outputs: dict[str, np.ndarray], labels: np.ndarray, logits: str | None) -> float:
    out = _pick(outputs, logits)
    value = label_accuracy(out, _indices(out, labels, "accuracy"))
    if value is None:
        raise ValueError("no labelled row or position")
    return value


def _token_accuracy(outputs: dict[str, np.ndarray], labels: np.ndarray, logits: str | None) -> float:
    if not per_position(labels):
        raise ValueError("token_accuracy needs integer labels per position ([N, seq]); these are one per row")
    return _accuracy(outputs, labels, logits)


def _macro_f1(outputs: dict[str, np.ndarray], labels: np.ndarray, logits: str | None) -> float:
    """F1 per class over the labelled rows/positions, averaged over the classes that occur in labels or answers."""
    out = _pick(outputs, logits)
    y = _indices(out, labels, "macro_f1").reshape(-1)
    pred = out.argmax(class_axis(out.ndim)).reshape(-1)
    keep = y != IGNORE_LABEL
    pred, y = pred[keep], y[keep]
    scores = []
    for c in np.union1d(pred, y):
        tp = np.sum((pred == c) & (y == c))
        denom = np.sum(pred == c) + np.sum(y == c)
        scores.append(2.0 * tp / denom if denom else 0.0)
    if not scores:
        raise ValueError("no labelled row or position")
    return float(np.mean(scores))


def _multilabel_f1(
    outputs: dict[str, np.ndarray], labels: np.ndarray, logits: str | None, threshold: float | None = None
) -> float:
    """Micro-averaged F1 of a multi-label head: scores ``[N, K]`` (one per label) against 0/1 targets of the same
    shape; every (row, label) pair counts once. A label is predicted where its logit is above 0, or, for a head
    that ends in a sigmoid (every score within [0, 1]), where its probability is above 0.5: the same decision.
    ``threshold``: the one read off the reference's scores (:func:`decided_by`), so that an engine whose score
    strays just below 0 is not judged by another threshold than the reference; else read off ``outputs``."""
    out = _pick(outputs, logits)
    if out.shape != labels.shape:
        raise ValueError(
            f"multilabel_f1 takes 0/1 targets shaped like the logits {list(out.shape)}, not {list(labels.shape)}"
        )
    at = decision_threshold(out) if threshold is None else threshold
    pred, y = out > at, labels > 0.5
    tp = np.sum(pred & y)
    denom = np.sum(pred) + np.sum(y)
    return float(2.0 * tp / denom) if denom else 1.0  # nothing predicted, nothing to find: perfect


def decision_threshold(scores: np.ndarray) -> float:
    """0.5 for probabilities (every score within [0, 1]: a sigmoid's output), 0 for logits."""
    finite = scores[np.isfinite(scores)]
    return 0.5 if finite.size and finite.min() >= 0.0 and finite.max() <= 1.0 else 0.0


class NoPrediction(ValueError):
    """No output is shaped like the targets: every built-in metric of predicted values fails alike."""


class LabelsMisshaped(ValueError):
    """The labels are not of the shape the metric reads: theirs to reshape, not the metric to change."""


# detection_recall's labels, as its fix says them
BOX_LABELS = (
    "[N, M, 5] rows of (class, x1, y1, x2, y2) per sample, a negative class (-1) on padding rows where a sample has "
    "fewer than M boxes"
)


def _misfit_hint(name: str, exc: Exception) -> str:
    """The fix for a built-in metric that does not fit the outputs: where no output is shaped like the targets
    (several targets per sample, one per output), no built-in reads them; where detection_recall's labels are
    misshaped (:class:`LabelsMisshaped`), their shape; else another built-in may."""
    own = "your own metric as 'module:function' (outputs: dict of name -> array, labels: array) -> float"
    if isinstance(exc, NoPrediction):
        return (
            f"give {own}, reading each output against its own columns of the targets (targets[:, 0], "
            "targets[:, 1:]): no built-in splits them"
        )
    if isinstance(exc, LabelsMisshaped) and name == "detection_recall":
        return f"give the held-out labels as {BOX_LABELS}; {BOX_FORMAT}"
    return f"pick another built-in ({', '.join(b for b in BUILTINS if b != name)}), or give {own}"


def prediction_candidates(outputs: dict[str, np.ndarray], labels: np.ndarray, logits: str | None) -> list[str]:
    """The outputs that could be the prediction of ``labels``: the one ``signature.logits_output`` names, the only
    one, else those with as many values as the targets."""
    if logits is not None and logits in outputs:
        return [logits]
    if len(outputs) == 1:
        return list(outputs)
    return [k for k, v in outputs.items() if np.size(v) == labels.size]


def _prediction(outputs: dict[str, np.ndarray], labels: np.ndarray, logits: str | None, name: str) -> np.ndarray:
    """The output a metric of predicted values scores (:func:`prediction_candidates`). Several that fit (a
    forecaster's mean and log-variance) are a ConfigError asking to name the prediction: the first of them is as
    likely the wrong one."""
    fit = prediction_candidates(outputs, labels, logits)
    if len(fit) == 1:
        return outputs[fit[0]]
    if not fit:
        raise NoPrediction(f"no output has as many values as the targets {list(labels.shape)}")
    raise ConfigError(
        f"validate.metric '{name}': outputs {', '.join(repr(k) for k in fit)} each fit targets "
        f"{labels.dtype}{list(labels.shape)}, and none is named as the prediction",
        hint=f"set signature.logits_output to the one that is the prediction ({' or '.join(fit)}): for float "
        "targets it names the output the metric and the training loss read, and holds it to no top-1 agreement",
    )


def _predicted(
    outputs: dict[str, np.ndarray], labels: np.ndarray, logits: str | None, name: str
) -> tuple[np.ndarray, np.ndarray]:
    """The prediction and the targets, flat and in float64, for an error metric ``name``."""
    out = _prediction(outputs, labels, logits, name).astype(np.float64)
    y = labels.astype(np.float64)
    if out.size != y.size:
        raise ValueError(f"output {list(out.shape)} and targets {list(y.shape)} differ in size")
    return out.reshape(-1), y.reshape(-1)


def _mse(outputs: dict[str, np.ndarray], labels: np.ndarray, logits: str | None) -> float:
    out, y = _predicted(outputs, labels, logits, "mse")
    return float(np.mean((out - y) ** 2))


def _rmse(outputs: dict[str, np.ndarray], labels: np.ndarray, logits: str | None) -> float:
    out, y = _predicted(outputs, labels, logits, "rmse")
    return float(np.sqrt(np.mean((out - y) ** 2)))


def _mae(outputs: dict[str, np.ndarray], labels: np.ndarray, logits: str | None) -> float:
    out, y = _predicted(outputs, labels, logits, "mae")
    return float(np.mean(np.abs(out - y)))


def _smape(outputs: dict[str, np.ndarray], labels: np.ndarray, logits: str | None) -> float:
    """Symmetric mean absolute percentage error, as a fraction in [0, 2]: the mean of |pred - y| / ((|pred| + |y|)
    / 2), a term where both are 0 counting 0. Scale-free, as forecasts of series in different units need. Chosen
    over MAPE, which divides by the target alone: a target of 0 (a day without sales, intermittent demand) makes it
    infinite and one near 0 outweighs every other term; sMAPE's denominator is 0 only where the forecast is exact."""
    out, y = _predicted(outputs, labels, logits, "smape")
    scale = (np.abs(out) + np.abs(y)) / 2.0
    terms = np.divide(np.abs(out - y), scale, out=np.zeros_like(scale), where=scale > 0)
    return float(np.mean(terms))


def _detection_recall(
    outputs: dict[str, np.ndarray], labels: np.ndarray, logits: str | None, num_classes: int = 0
) -> float:
    """Of the labelled boxes, the fraction found: a confident prediction whose class is the box's and whose box
    overlaps it by IoU >= :data:`IOU`, each prediction finding one box at most (greedy by IoU).

    A prediction is confident where its class's score says the class is present, a probability of 0.5 or more
    (:func:`_class_decisions`): a dense head answers at every anchor, and recall over all of them would credit a
    head whose scores say nothing is there (an engine that crushes every score keeps its boxes). For another
    threshold, or average precision over the ranked scores, give your own metric.

    ``outputs``: boxes ``[N, K, 4]`` (x1, y1, x2, y2, in the labels' units) and class scores ``[N, K, C]``, told
    apart by :func:`_detection_outputs`; ``labels``: ``[N, M, 5]`` rows of (class, x1, y1, x2, y2), a negative
    class marking padding; ``num_classes``: the data's (0: not declared)."""
    if labels.ndim != 3 or labels.shape[-1] != 5:
        raise LabelsMisshaped(f"detection_recall needs labels {BOX_LABELS}")
    box_name, score_name = _detection_outputs(outputs, logits)
    boxes = outputs[box_name]
    predicted, confident = _class_decisions(outputs[score_name], num_classes)
    found = total = 0
    for b, classes, sure, y in zip(boxes, predicted, confident, labels):
        free = sure.copy()
        for row in y[y[:, 0] >= 0]:
            total += 1
            ious = np.where(free & (classes == int(row[0])), _iou(b, row[1:]), 0.0)
            k = int(ious.argmax()) if len(ious) else 0
            if len(ious) and ious[k] >= IOU:
                found, free[k] = found + 1, False
    if not total:
        raise ValueError("no labelled box")
    return found / total


def _class_decisions(scores: np.ndarray, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """Each prediction's class and whether it is confident, from class scores ``[N, K, C]``. Where ``C`` is the
    data's ``num_classes`` + 1, they are a DETR-style head's logits (DETR, YOLOS): a softmax over every class, the
    last "no object"; the class is the likeliest real one, confident where its softmax probability is 0.5 or more
    (scores within [0, 1] that sum to 1 are taken as that softmax's output already),
    which a uniform shift of the logits (that softmax ignores) leaves as it is. Elsewhere (``num_classes`` unknown,
    or ``C`` equal to it) each class is scored on its own, a sigmoid's: the top class, confident where its score is
    0.5 or more as a probability, 0 or more as a logit (:func:`decision_threshold`, the decision ``multilabel_f1``
    makes too)."""
    threshold = decision_threshold(scores)
    if not num_classes or scores.shape[-1] != num_classes + 1:
        return scores.argmax(-1), scores.max(-1) >= threshold
    if threshold == 0.5 and np.allclose(scores.sum(-1), 1.0, atol=0.02):  # a wrapper's softmax: not twice
        real = scores[..., :-1]
    else:
        from scipy.special import softmax  # here: scipy's import is slow, and only this metric needs it

        real = softmax(scores.astype(np.float64), axis=-1)[..., :-1]
    return real.argmax(-1), real.max(-1) >= 0.5


def _detection_outputs(outputs: dict[str, np.ndarray], logits: str | None) -> tuple[str, str]:
    """The names of the boxes and the class-score outputs of a dense detection head. The scores: the output
    ``signature.logits_output`` names, else the one named like scores (:data:`SCORE_NAMES`), else the only
    ``[N, K, *]`` output beside the boxes. The boxes: of the other ``[N, K, 4]`` outputs, the one named like boxes
    (:data:`BOX_NAMES`), else the only one. Four classes make scores ``[N, K, 4]`` too: where names do not tell
    the two apart, a ConfigError asks to name the scores, since either guess is as likely wrong (and the wrong one
    scores 0 for every engine and the reference alike)."""
    dense = {k: v for k, v in outputs.items() if np.ndim(v) == 3}
    named = logits if logits in dense else None
    fits = [k for k, v in dense.items() if v.shape[-1] == 4 and k != named]
    boxes = _by_name(fits, BOX_NAMES, SCORE_NAMES)
    if boxes is None and len(fits) > 1:
        raise _ambiguous(fits, "boxes", outputs)
    if boxes is None:
        raise ValueError("detection_recall needs boxes [N, K, 4], class scores [N, K, C] and labels [N, M, 5]")
    if named is not None:
        return boxes, named
    rest = [k for k, v in dense.items() if k != boxes and v.shape[:2] == dense[boxes].shape[:2]]
    scores = _by_name(rest, SCORE_NAMES, BOX_NAMES)
    if scores is None and len(rest) > 1:
        raise _ambiguous(rest, "class scores", outputs)
    if scores is None:
        raise ValueError("detection_recall needs boxes [N, K, 4], class scores [N, K, C] and labels [N, M, 5]")
    return boxes, scores


def _by_name(names: list[str], like: re.Pattern[str], unlike: re.Pattern[str]) -> str | None:
    """The one of ``names`` named ``like`` and not ``unlike``; else, where there is one name only, that one."""
    hits = [k for k in names if like.search(k) and not unlike.search(k)]
    if len(hits) == 1:
        return hits[0]
    return names[0] if len(names) == 1 else None


def _ambiguous(names: list[str], what: str, outputs: dict[str, np.ndarray]) -> ConfigError:
    return ConfigError(
        f"validate.metric 'detection_recall': outputs {', '.join(repr(k) for k in names)} could each be the {what} "
        f"({_shapes(outputs)}), and their names do not say which holds boxes and which class scores",
        hint=f"set signature.logits_output to the class-score output ({' or '.join(names)}); the metric takes the "
        "other [N, K, 4] output as the boxes (or name the outputs boxes and scores in the model)",
    )


def _iou(boxes: np.ndarray, box: np.ndarray) -> np.ndarray:
    x1, y1 = np.maximum(boxes[:, 0], box[0]), np.maximum(boxes[:, 1], box[1])
    x2, y2 = np.minimum(boxes[:, 2], box[2]), np.minimum(boxes[:, 3], box[3])
    inter = np.clip(x2 - x1, 0, None) * np.clip(y2 - y1, 0, None)
    area = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1]) + (box[2] - box[0]) * (box[3] - box[1])
    return inter / np.maximum(area - inter, 1e-12)


def _shapes(outputs: dict[str, np.ndarray]) -> str:
    return "{" + ", ".join(f"{k}: {list(np.shape(v))}" for k, v in outputs.items()) + "}"


# name -> (function of (outputs, labels, logits name), higher is better)
BUILTINS: dict[str, tuple[Callable[..., float], bool]] = {
    "accuracy": (_accuracy, True),
    "macro_f1": (_macro_f1, True),
    "multilabel_f1": (_multilabel_f1, True),
    "token_accuracy": (_token_accuracy, True),
    "mse": (_mse, False),
    "rmse": (_rmse, False),
    "mae": (_mae, False),
    "smape": (_smape, False),
    "detection_recall": (_detection_recall, True),
}
DEFAULT = "mse"  # the metric of float targets where validate.metric is unset (default_metric)
TAKES_CLASSES = frozenset({"detection_recall"})  # built-ins that read the data's num_classes (resolve_metric)
# the error metrics, judged by their relative rise (Metric.drop): mse, rmse and mae over the targets' spread in their
# units (SPREADS); smape is scale-free, over the reference's value so that every error metric reads one way (a good
# forecast's 2 % sMAPE made 3 % is 50 % worse, which a fixed allowance of 0.01 would pass)
RELATIVE = frozenset({"mse", "rmse", "mae", "smape"})
# the targets' spread in each error metric's units, of their deviations from their mean (scaled_by)
SPREADS: dict[str, Callable[[np.ndarray], float]] = {
    "mse": lambda d: np.mean(d**2),
    "rmse": lambda d: np.sqrt(np.mean(d**2)),
    "mae": lambda d: np.mean(np.abs(d)),
}
# each spread as the report and warnings name it
SPREAD_NAMES = {"mse": "variance", "rmse": "standard deviation", "mae": "mean absolute deviation"}


def worse_than_mean_note(metric: Metric | None, baseline: float | None) -> str | None:
    """Where the reference errs more than the targets spread (:meth:`Metric.worse_than_mean`), what that means for
    ``max_metric_drop``; None elsewhere. Such a reference predicts worse than the targets' mean (an MSE's R^2 < 0:
    an offset or scale it never learned), so agreeing with it says little about the task."""
    if metric is None or metric.scale is None or baseline is None or not metric.worse_than_mean(baseline):
        return None
    spread = SPREAD_NAMES.get(metric.name, "spread")
    said, scale = _apart(baseline, metric.scale)
    squared = {"mse": 1, "rmse": 2}.get(metric.name)
    r2 = f" (R^2 = {1 - (abs(baseline) / metric.scale) ** squared:.2g} < 0)" if squared else ""
    return (
        f"the reference's {metric.name} ({said}) exceeds the targets' {spread} ({scale}): it predicts worse than "
        f"their mean would{r2}, so max_metric_drop holds each engine's rise over the reference's own {metric.name}, "
        "and the gate says little about the task; check the model's training and the targets (an offset or scale it "
        "does not fit: normalise them)"
    )


def _apart(a: float, b: float) -> tuple[str, str]:
    """``a`` and ``b`` to 4 significant digits, or as many more as it takes for two different numbers to read
    differently (an all-zero model's MSE just over the targets' variance of 1)."""
    for digits in range(4, 18):
        shown = f"{a:.{digits}g}", f"{b:.{digits}g}"
        if shown[0] != shown[1] or a == b:
            return shown
    return shown


def metric_labels(val_y: Any) -> np.ndarray | None:
    """The held-out labels as the metric gets them (numpy), or None."""
    if val_y is None:
        return None
    return val_y.numpy() if hasattr(val_y, "numpy") else np.asarray(val_y)
