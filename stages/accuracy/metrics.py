"""The user's metric (``validate.metric``): the number their task is judged by, on the held-out split, for the
baseline and every engine, gated by its drop (``validate.gates.max_metric_drop``, per precision).

Tensor cosine and top-1 agreement are proxies; users state accuracy budgets as a drop in their own metric (as
NNCF's accuracy-aware quantization and Olive's metric goals do). A metric is ``fn(outputs, labels) -> float``:
``outputs`` the model's outputs by name (graph order), ``labels`` the held-out ``val_y`` as a numpy array. Higher
is better unless the function says otherwise (an attribute ``higher_is_better = False``) or the config does.

Built-ins, for what users ask most (each reads the class-logit output, ``signature.logits_output``, where it
needs one): ``accuracy``, ``macro_f1``, ``multilabel_f1`` (0/1 targets shaped like the logits), ``token_accuracy``
(labels per position, padding excluded), ``mse`` (lower is better) and ``detection_recall`` (box-and-class heads,
below).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kiln.core.compare import class_axis
from kiln.core.errors import ConfigError, KilnError, ModelError
from kiln.core.labels import IGNORE_LABEL, are_indices, per_position
from kiln.core.labels import accuracy as label_accuracy
from kiln.models.registry import resolve_callable

MetricFn = Callable[[dict[str, np.ndarray], np.ndarray], float]
IOU = 0.5  # detection_recall: a label box is found by a prediction of its class overlapping it this much


@dataclass(frozen=True)
class Metric:
    """A resolved metric: its name (as configured), function and direction."""

    name: str
    fn: MetricFn
    higher_is_better: bool = True

    def __call__(self, outputs: dict[str, np.ndarray], labels: np.ndarray) -> float:
        """The metric of ``outputs``; the user's function failing is their error, named with what Kiln was doing."""
        try:
            returned = self.fn(outputs, labels)
        except KilnError:  # a built-in's own error, with its own fix
            raise
        except Exception as exc:  # the user's function (or a built-in on outputs it does not fit): one line
            if self.name in BUILTINS:  # Kiln's own: what it takes, not where in Kiln it raised
                raise ModelError(
                    f"validate.metric '{self.name}' does not fit outputs {_shapes(outputs)} and labels "
                    f"{labels.dtype}{list(labels.shape)}: {exc}",
                    hint=f"pick another built-in ({', '.join(b for b in BUILTINS if b != self.name)}), or give "
                    "your own metric as 'module:function' (outputs: dict of name -> array, labels: array) -> float",
                ) from None
            frame = traceback.extract_tb(exc.__traceback__)[-1]  # where it raised: the user's line
            at = f" ({frame.filename}:{frame.lineno})"
            raise ModelError(
                f"validate.metric '{self.name}'{at} failed on outputs {_shapes(outputs)} and labels "
                f"{labels.dtype}{list(labels.shape)}: {type(exc).__name__}: {exc}",
                hint="the metric takes (outputs: dict of name -> array, labels: array) and returns a float",
            ) from None
        value = _as_float(returned, self.name)
        if not np.isfinite(value):
            raise ModelError(
                f"validate.metric '{self.name}' returned {value} on outputs {_shapes(outputs)}",
                hint="return a finite float (e.g. guard divisions by zero)",
            )
        return value

    def drop(self, baseline: float, value: float) -> float:
        """How much worse ``value`` is than ``baseline`` (positive: worse), whichever way the metric points."""
        return baseline - value if self.higher_is_better else value - baseline


def _as_float(returned: object, name: str) -> float:
    """A metric's value as a float: a number, or an array or tensor of one element."""
    try:
        value = np.asarray(returned, dtype=np.float64)
    except (TypeError, ValueError, RuntimeError):  # a str, a dict, a tensor that needs grad
        value = None
    if value is None or value.size != 1:
        shape = getattr(returned, "shape", None)
        what = f"an array of shape {tuple(shape)}" if shape is not None else type(returned).__name__
        raise ModelError(
            f"validate.metric '{name}' returned {what}, not a float",
            hint="return one float for the whole set (e.g. a mean over the samples: float(scores.mean()))",
        )
    return float(value.reshape(()))


def resolve_metric(ref: str | None, logits: str | None, higher_is_better: bool | None = None) -> Metric | None:
    """``validate.metric``: a built-in name or ``pkg.mod:fn`` (imported here; a bad path is a ConfigError)."""
    if ref is None:
        return None
    if ref in BUILTINS:
        fn, higher = BUILTINS[ref]
        if higher_is_better is not None:
            higher = higher_is_better
        return Metric(ref, _on_logits(fn, logits, ref), higher)
    fn = resolve_callable(ref, {}, "validate.metric")
    default = bool(getattr(fn, "higher_is_better", True))
    return Metric(ref, fn, default if higher_is_better is None else higher_is_better)


def _on_logits(fn: Callable[..., float], logits: str | None, name: str) -> MetricFn:
    def metric(outputs: dict[str, np.ndarray], labels: np.ndarray) -> float:
        return fn(outputs, labels, logits)

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
            f"{labels.dtype}{list(labels.shape)}"
            + (" (multi-label: multilabel_f1)" if labels.shape == out.shape else "")
        )
    return y


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


def _multilabel_f1(outputs: dict[str, np.ndarray], labels: np.ndarray, logits: str | None) -> float:
    """Micro-averaged F1 of a multi-label head: scores ``[N, K]`` (one per label) against 0/1 targets of the same
    shape; every (row, label) pair counts once. A label is predicted where its logit is above 0, or, for a head
    that ends in a sigmoid (every score within [0, 1]), where its probability is above 0.5: the same decision."""
    out = _pick(outputs, logits)
    if out.shape != labels.shape:
        raise ValueError(
            f"multilabel_f1 takes 0/1 targets shaped like the logits {list(out.shape)}, not {list(labels.shape)}"
        )
    pred, y = out > decision_threshold(out), labels > 0.5
    tp = np.sum(pred & y)
    denom = np.sum(pred) + np.sum(y)
    return float(2.0 * tp / denom) if denom else 1.0  # nothing predicted, nothing to find: perfect


def decision_threshold(scores: np.ndarray) -> float:
    """0.5 for probabilities (every score within [0, 1]: a sigmoid's output), 0 for logits."""
    finite = scores[np.isfinite(scores)]
    return 0.5 if finite.size and finite.min() >= 0.0 and finite.max() <= 1.0 else 0.0


def _prediction(outputs: dict[str, np.ndarray], labels: np.ndarray, logits: str | None, name: str) -> np.ndarray:
    """The output a metric of predicted values scores: the one ``signature.logits_output`` names, the only one, or
    the only one with as many values as the targets. Several that fit (a forecaster's mean and log-variance) are a
    ConfigError asking to name the prediction: the first of them is as likely the wrong one."""
    if logits is not None and logits in outputs:
        return outputs[logits]
    if len(outputs) == 1:
        return next(iter(outputs.values()))
    fit = [k for k, v in outputs.items() if np.size(v) == labels.size]
    if len(fit) == 1:
        return outputs[fit[0]]
    if not fit:
        raise ValueError(f"no output has as many values as the targets {list(labels.shape)}")
    raise ConfigError(
        f"validate.metric '{name}': outputs {', '.join(repr(k) for k in fit)} each fit targets "
        f"{labels.dtype}{list(labels.shape)}, and none is named as the prediction",
        hint=f"set signature.logits_output to the one that is the prediction ({' or '.join(fit)}): for float "
        "targets it names the output the metric and the training loss read, and holds it to no top-1 agreement",
    )


def _mse(outputs: dict[str, np.ndarray], labels: np.ndarray, logits: str | None) -> float:
    out = _prediction(outputs, labels, logits, "mse").astype(np.float64)
    y = labels.astype(np.float64)
    if out.size != y.size:
        raise ValueError(f"output {list(out.shape)} and targets {list(y.shape)} differ in size")
    return float(np.mean((out.reshape(-1) - y.reshape(-1)) ** 2))


def _detection_recall(outputs: dict[str, np.ndarray], labels: np.ndarray, logits: str | None) -> float:
    """Of the labelled boxes, the fraction found: a prediction whose argmax class is the box's and whose box
    overlaps it by IoU >= :data:`IOU`, each prediction finding one box at most (greedy by IoU).

    ``outputs``: a boxes output ``[N, K, 4]`` (x1, y1, x2, y2) and a class-score output ``[N, K, C]`` (the class
    logits: the one named by ``signature.logits_output``, else the other ``[N, K, *]`` output); ``labels``:
    ``[N, M, 5]`` rows of (class, x1, y1, x2, y2), a negative class marking padding."""
    boxes = next((v for v in outputs.values() if v.ndim == 3 and v.shape[-1] == 4), None)
    scores = outputs.get(logits) if logits is not None else None
    if scores is None or scores is boxes:
        scores = next((v for v in outputs.values() if v.ndim == 3 and v is not boxes), None)
    if boxes is None or scores is None or labels.ndim != 3 or labels.shape[-1] != 5:
        raise ValueError("detection_recall needs boxes [N, K, 4], class scores [N, K, C] and labels [N, M, 5]")
    found = total = 0
    for b, s, y in zip(boxes, scores, labels):
        classes = s.argmax(-1)
        free = np.ones(len(b), dtype=bool)
        for row in y[y[:, 0] >= 0]:
            total += 1
            ious = np.where(free & (classes == int(row[0])), _iou(b, row[1:]), 0.0)
            k = int(ious.argmax()) if len(ious) else 0
            if len(ious) and ious[k] >= IOU:
                found, free[k] = found + 1, False
    if not total:
        raise ValueError("no labelled box")
    return found / total


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
    "detection_recall": (_detection_recall, True),
}


def metric_labels(val_y: Any) -> np.ndarray | None:
    """The held-out labels as the metric gets them (numpy), or None."""
    if val_y is None:
        return None
    return val_y.numpy() if hasattr(val_y, "numpy") else np.asarray(val_y)
