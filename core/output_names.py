"""Which of a model's named outputs holds the class logits (``signature.logits_output``), without torch: the commands
that run ONNX files (``kiln build``, ``kiln precision``, ``kiln validate``) read it and load no torch."""

from __future__ import annotations

import difflib
import json
import re
import shlex
from collections.abc import Sequence
from typing import Any

import numpy as np
import yaml

from kiln.core.compare import class_axis
from kiln.core.data import tensors
from kiln.core.errors import ConfigError
from kiln.core.labels import floating
from kiln.core.text import FEATURE_NAMES

SINGLE_OUTPUT = "logits"
BOX_NAMES = re.compile(r"box|bbox", re.IGNORECASE)  # boxes, bbox, pred_boxes, bbox_pred
SCORE_NAMES = re.compile(r"score|logit|cls|class|conf|prob", re.IGNORECASE)  # scores, pred_logits, cls_score


def logits_name(names: Sequence[str], setting: str | int | None) -> str | None:
    """``signature.logits_output``: the named or indexed output; default the only output (unless its name says it
    holds features: :data:`FEATURE_NAMES`), else ``logits``, else None (no class logits: no accuracy, no top-1). A
    number that is an output's name is that output, not an index: the TorchScript exporter names outputs ``18`` or
    ``0``, and YAML and ``--set`` read ``18`` as a number."""
    if setting is None:
        if len(names) == 1 and not FEATURE_NAMES.search(names[0]):
            return names[0]
        return SINGLE_OUTPUT if SINGLE_OUTPUT in names else None
    if str(setting) in names:
        return str(setting)
    if isinstance(setting, int):
        if not -len(names) <= setting < len(names):
            raise ConfigError(
                f"signature.logits_output {setting} is out of range: the model has {len(names)} outputs {list(names)}",
                hint=_naming_hint(names, "give an index below the number of outputs, or a name"),
            )
        return names[setting]
    raise ConfigError(
        f"signature.logits_output '{setting}' is not an output of the model: {list(names)}",
        hint=_naming_hint(names, "name one of the model's outputs, or give its index"),
    )


def _naming_hint(names: Sequence[str], what: str) -> str:
    """The fix for a ``signature.logits_output`` that is none of ``names``: ``what``, with the ``--set`` naming the
    first output as the CLI reads it (:func:`logits_flag`); none where there is no output to name."""
    if not names:
        return "leave signature.logits_output out: the model has no outputs to name"
    return f"{what} (e.g. {logits_flag(names[0])})"


def logits_flag(name: str) -> str:
    """The ``--set`` that names output ``name`` as ``signature.logits_output``, quoted so that the CLI reads it as
    that name: ``--set 'signature.logits_output="18"'`` (YAML would read a bare ``18`` as a number, ``true`` or
    ``null`` as no name at all)."""
    try:
        plain = yaml.safe_load(name) == name and name.strip() == name
    except yaml.YAMLError:
        plain = False
    value = name if plain else json.dumps(name)
    return f"--set {shlex.quote(f'signature.logits_output={value}')}"


def class_logits(names: Sequence[str], setting: str | int | None, labels: Any, num_classes: int = 0) -> str | None:
    """:func:`logits_name` for a run with ``labels`` (the held-out targets): float targets are a regression's, whose
    output holds values, not class logits, unless ``signature.logits_output`` names one or they are class labels
    one-hot encoded (:func:`one_hot`, ``num_classes`` wide where the data gives it), whose argmax is the class."""
    if setting is None and labels is not None:
        y = tensors(labels)[0]
        if detection_labels(y):
            return detection_scores(names)
        if floating(y) and not one_hot(y, num_classes):
            return None
    return logits_name(names, setting)


def detection_labels(y: Any) -> bool:
    """Float labels ``[N, M, 5]`` (a tensor or an array): a detector's rows of (class, x1, y1, x2, y2), which
    ``detection_recall`` scores against its boxes and class scores."""
    a = y if hasattr(y, "dtype") else np.asarray(y)
    return floating(a) and a.ndim == 3 and a.shape[-1] == 5


def detection_scores(names: Sequence[str]) -> str | None:
    """Of a detector's outputs, the class scores ``detection_recall`` reads beside its boxes, told by name: the one
    named like scores and not like boxes (:data:`SCORE_NAMES`: ``logits``, ``pred_logits``, ``scores``), else the
    one output beside the only one named like boxes (:data:`BOX_NAMES`); None where names do not tell. Their argmax
    is the class decision, a DETR-style head's "no object" included."""
    boxes = [n for n in names if BOX_NAMES.search(n) and not SCORE_NAMES.search(n)]
    rest = [n for n in names if n not in boxes]
    scores = [n for n in rest if SCORE_NAMES.search(n) and not BOX_NAMES.search(n)]
    if len(scores) == 1:
        return scores[0]
    return rest[0] if len(boxes) == 1 and len(rest) == 1 else None


def one_hot(y: Any, num_classes: int = 0) -> bool:
    """Float 0/1 labels (a tensor or an array) with exactly one 1 in each row or position along their class axis
    (:func:`class_axis`: 1 for ``[N, C]`` and ``[N, C, H, W]``, the last for ``[N, seq, C]``) of two entries or more,
    ``num_classes`` of them where it is given: ``F.one_hot(y, C).float()``, class labels as training tells them from
    multi-hot or regression targets."""
    a = np.asarray(y.detach().cpu() if hasattr(y, "detach") else y)
    if a.ndim < 2 or not a.size or a.dtype.kind != "f":
        return False
    axis = class_axis(a.ndim) % a.ndim
    if a.shape[axis] < 2 or (num_classes > 0 and a.shape[axis] != num_classes):
        return False
    return bool(np.isin(a, (0, 1)).all()) and bool((a.sum(axis) == 1).all())


def refuse_unknown_gated(names: Sequence[str] | None, outputs: list[str]) -> None:
    """Each of ``validate.gates.gated_outputs`` (``names``; None: every output) is one of the model's ``outputs``, or
    a ConfigError names the closest (a misspelt name) and the outputs there are."""
    unknown = [n for n in names or () if n not in outputs]
    if not unknown:
        return
    close = {n: difflib.get_close_matches(n, outputs, 1) for n in unknown}
    meant = [f"'{close[n][0]}' for '{n}'" for n in unknown if close[n]]
    raise ConfigError(
        f"validate.gates.gated_outputs names {unknown}, which the model has no output of (its outputs: {outputs})",
        hint=(f"did you mean {', '.join(meant)}? " if meant else "")
        + f"list outputs of {outputs} in validate.gates.gated_outputs, or set it to null to gate every output",
    )
