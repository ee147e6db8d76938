"""The dataset contract every stage reads: what a user's data function returns, and how a model takes it.

``x`` is one tensor (``model(x)``), a tuple of tensors (``model(*x)``) or a dict of named tensors
(``model(**x)``); integer and float inputs may be mixed. ``y`` is optional: integer class labels, float targets,
or ``None`` (then a model can be compiled and validated by agreement with PyTorch, but not trained).
Every stage reaches the inputs through the helpers here, so the three forms mean the same everywhere.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias, TypeGuard

import numpy as np

from kiln.core.errors import ConfigError
from kiln.core.inputs import batch_of_one_hint, float_ranges
from kiln.core.labels import IGNORE_LABEL
from kiln.core.records import IntRange, TensorSpec, trailing_axes

if TYPE_CHECKING:  # torch is imported where a tensor is made: the ONNX-only commands load none
    import torch

Inputs: TypeAlias = "torch.Tensor | tuple[torch.Tensor, ...] | dict[str, torch.Tensor]"
SINGLE_INPUT = "input"  # the ONNX name of a model's only input, when it is passed as a bare tensor


@dataclass
class DatasetSplits:
    """Train and held-out splits. ``num_classes``: 0 (or None) for a task without classes (regression,
    embeddings)."""

    train_x: Inputs
    train_y: torch.Tensor | None
    val_x: Inputs
    val_y: torch.Tensor | None
    num_classes: int = 0
    name: str = "dataset"

    def __post_init__(self) -> None:
        if self.num_classes is None:  # "no classes", as a user may well write it
            self.num_classes = 0
        # a list of input tensors is the tuple a user meant (model(*x)): the contract's structures are tuples
        for field in ("train_x", "val_x"):
            if isinstance(getattr(self, field), list):
                setattr(self, field, tuple(getattr(self, field)))

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one sample of the first input, without the batch axis."""
        return tuple(tensors(self.val_x)[0].shape[1:])

    @property
    def sample_shapes(self) -> dict[str, list[int]]:
        """Per input (by position or key), the shape of one sample."""
        return {k: list(t.shape[1:]) for k, t in zip(_keys(self.val_x), tensors(self.val_x))}

    @property
    def classification(self) -> bool:
        """Integer labels: a classification task (cross-entropy, accuracy)."""
        y = self.train_y if self.train_y is not None else self.val_y
        return y is not None and not y.is_floating_point()


# --------------------------------------------------------------------------------------------------- structure
def is_tensor(x: Any) -> TypeGuard[torch.Tensor]:
    """Whether ``x`` is a torch tensor, without importing torch: an object can be one only once torch is loaded."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def tensors(x: Inputs) -> list[torch.Tensor]:
    """The input tensors in call order."""
    if is_tensor(x):
        return [x]
    return list(x.values()) if isinstance(x, Mapping) else list(x)


def _keys(x: Inputs) -> list[str]:
    if is_tensor(x):
        return [SINGLE_INPUT]
    return [str(k) for k in x] if isinstance(x, Mapping) else [str(i) for i in range(len(x))]


def rebuild(like: Inputs, parts: list[Any]) -> Any:
    """``parts`` (one per input, in call order) in the structure of ``like``."""
    if is_tensor(like):
        return parts[0]
    if isinstance(like, Mapping):
        return dict(zip(like, parts))
    return tuple(parts)


def rows(x: Inputs) -> int:
    return len(tensors(x)[0])


def take(x: Inputs, index: Any) -> Any:
    """The same rows (a slice or an index tensor) of every input."""
    return rebuild(x, [t[index] for t in tensors(x)])


def call(model: Any, x: Any) -> Any:
    """``model(x)``, ``model(*x)`` or ``model(**x)``, by the structure of ``x``."""
    if isinstance(x, Mapping):
        return model(**x)
    if isinstance(x, (tuple, list)):
        return model(*x)
    return model(x)


def input_names(model: Any, x: Inputs) -> list[str]:
    """ONNX input names: the dict keys, the forward's parameter names for a tuple, ``input`` for one tensor."""
    if is_tensor(x):
        return [SINGLE_INPUT]
    if isinstance(x, Mapping):
        return [str(k) for k in x]
    params = [p.name for p in _forward_params(model) if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return [params[i] if i < len(params) else f"input_{i}" for i in range(len(x))]


def check_axes_name_inputs(model: Any, x: Inputs, dynamic_axes: Mapping[str, Any] | None) -> None:
    """``signature.dynamic_axes`` keyed by the model's input names (:func:`input_names`), each name one size in
    ``x`` (:func:`check_tied_sizes`), or one error saying which keys are not, or which name is not: checked before
    training as well as at export, so a typo costs no training run. The data check (:func:`check_splits`) does the
    second for data as a tensor or a dict; a tuple's names come with the model, here."""
    names = input_names(model, x)
    unknown = sorted(set(dynamic_axes or {}) - set(names))
    if unknown:
        single = is_tensor(x)  # one tensor of data is the input "input", whatever forward calls it
        raise ConfigError(
            f"signature.dynamic_axes names {unknown}, which are not model inputs {names}",
            hint=f"key signature.dynamic_axes by the model's input names (data of one tensor is the input "
            f"'{names[0]}'; data as a dict {{name: tensor}} names it)"
            if single
            else "key signature.dynamic_axes by the model's input names",
        )
    check_tied_sizes(x, names, dynamic_axes or {}, "the data")


# An axis of signature.dynamic_axes as the data gives it: input name, axis, size
_NamedAxis = tuple[str, int, int]


def check_tied_sizes(x: Inputs, names: list[str], dynamic: Mapping[str, Mapping[Any, str]], whose: str) -> None:
    """Axes that share a name in ``dynamic`` (``signature.dynamic_axes``) are one size: the exporter ties them, and
    Kiln resizes them together. ``x`` (one batch, its inputs named ``names``; ``whose``: what it is, in words) giving
    them different sizes is a mistake in the names (``{2: frames, 3: frames}`` for frames and height), said here
    before the exporter fails on it; inputs the names do not match are left to the other checks."""
    shapes = {n: tuple(t.shape) for n, t in zip(names, tensors(x))}
    named: dict[str, list[_NamedAxis]] = {}
    for name, dims in dynamic.items():
        shape = shapes.get(str(name))
        for axis, label in (dims or {}).items():
            if shape is not None and 0 <= int(axis) < len(shape):
                named.setdefault(str(label), []).append((str(name), int(axis), shape[int(axis)]))
    for label, axes in named.items():
        if len({size for *_, size in axes}) > 1:
            raise _tied_error(label, axes, dynamic, whose)


def _tied_error(
    label: str, axes: list[_NamedAxis], dynamic: Mapping[str, Mapping[Any, str]], whose: str
) -> DataContractError:
    """The error for axes named ``label`` that ``whose`` gives different sizes; its fix names each size apart."""
    inputs = {name for name, _, _ in axes}
    if len(inputs) == 1:
        where = f"input '{axes[0][0]}' axes " + _and_list(str(axis) for _, axis, _ in axes)
    else:
        where = _and_list(f"input '{name}' axis {axis}" for name, axis, _ in axes)
    both = "both" if len(axes) == 2 else "all"
    sizes = _and_list(str(size) for *_, size in axes)
    return DataContractError(
        f"{where} are {both} named '{label}' in signature.dynamic_axes, but {whose} gives them {sizes}: axes that "
        "share a name have one size in every batch",
        hint=f"give each axis its own name (signature.dynamic_axes: {_renamed(label, axes, dynamic)}), or, where "
        "they must be equal, give data where they are",
    )


def _renamed(label: str, axes: list[_NamedAxis], dynamic: Mapping[str, Mapping[Any, str]]) -> str:
    """``dynamic`` as YAML flow, the axes named ``label`` of each size but the first given a name of their own."""
    taken = {str(lbl) for dims in dynamic.values() for lbl in (dims or {}).values()}
    fresh = (f"{label}_{i}" for i in range(2, 2 + len(taken) + len(axes)) if f"{label}_{i}" not in taken)
    by_size = {size: label if i == 0 else next(fresh) for i, size in enumerate(dict.fromkeys(s for *_, s in axes))}
    new = {(name, axis): by_size[size] for name, axis, size in axes}
    inner = (
        f"{name}: {{"
        + ", ".join(f"{int(ax)}: {new.get((str(name), int(ax)), lbl)}" for ax, lbl in (dims or {}).items())
        + "}"
        for name, dims in dynamic.items()
    )
    return "{" + ", ".join(inner) + "}"


def _and_list(items: Any) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    words = list(items)
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def by_keyword(model: Any, names: list[str]) -> bool:
    """Whether a model whose ONNX inputs are ``names`` (:func:`input_names`) is called with them as keywords: a
    dict's keys always are (``model(**x)``), and a tuple's names are the forward's own parameters, so the call is
    the same. Only a bare tensor (``input``) or inputs beyond the forward's named parameters go by position."""
    if names == [SINGLE_INPUT]:
        return False
    params = _forward_params(model)
    if any(p.kind == p.VAR_KEYWORD for p in params):
        return True
    return set(names) <= {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def forward_inputs(model: Any) -> list[str]:
    """The names of the inputs a model's forward takes (its named parameters, not ``*args``/``**kwargs``)."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in _forward_params(model) if p.kind in kinds]


def _forward_params(model: Any) -> list[inspect.Parameter]:
    try:
        return list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):  # a builtin or C++ forward: no signature to read
        return []


def as_feed(x: Inputs, names: list[str]) -> dict[str, np.ndarray]:
    """The inputs as named numpy arrays (an ONNX Runtime feed)."""
    return {n: t.detach().cpu().numpy() for n, t in zip(names, tensors(x))}


def feed_for_graph(x: Inputs, names: list[str], where: str = "the ONNX model") -> dict[str, np.ndarray]:
    """The inputs as a feed for a graph taking ``names``: a dict by key, a tuple or tensor by position."""
    if isinstance(x, Mapping):
        if sorted(x) != sorted(names):
            raise DataContractError(
                f"the data's inputs {sorted(x)} are not those of {where}: {names}",
                hint="key the data function's dict by the ONNX model's input names",
            )
        return {n: x[n].detach().cpu().numpy() for n in names}
    if len(tensors(x)) != len(names):
        raise DataContractError(
            f"the data gives {len(tensors(x))} inputs, {where} takes {len(names)}: {names}",
            hint="give one tensor per model input (a dict keyed by the input names is clearest)",
        )
    return as_feed(x, names)


def from_feed(feed: Mapping[str, np.ndarray], like: Inputs) -> Any:
    """A feed back into the model's call structure (as ``like``), as torch tensors."""
    import torch

    return rebuild(like, [torch.from_numpy(np.ascontiguousarray(a)) for a in feed.values()])


# ---------------------------------------------------------------------------------------------- feeds (numpy)
Feed = dict[str, np.ndarray]


def feed_rows(feed: Mapping[str, np.ndarray]) -> int:
    return len(next(iter(feed.values())))


def feed_take(feed: Mapping[str, np.ndarray], index: Any) -> Feed:
    return {k: v[index] for k, v in feed.items()}


# --------------------------------------------------------------------------------------------------- the checks
class DataContractError(ConfigError):
    """The data function's splits break the dataset contract."""


_MANY_INPUTS = 8  # a list or tuple of more tensors is likelier samples than a forward()'s arguments


def check_splits(data: DatasetSplits, ref: str, dynamic: Mapping[str, Mapping[int, str]] | None = None) -> None:
    """Every contract violation as one error naming the cause: types, structures that differ between train and
    val, row counts that differ, sample shapes that differ (axes named in ``dynamic`` may differ)."""
    for split in ("train", "val"):
        x, y = getattr(data, f"{split}_x"), getattr(data, f"{split}_y")
        _check_x(x, f"{split}_x", ref)
        if y is not None and not is_tensor(y):
            raise DataContractError(
                f"dataset '{ref}' gives {split}_y as {type(y).__name__}, not a torch.Tensor or None",
                hint=_labels_hint(y, rows(x)),
            )
        # a tuple's inputs by position (forward's parameter names come with the model, not here)
        names = _keys(x) if isinstance(x, Mapping) else [f"{split}_x[{i}]" for i in range(len(tensors(x)))]
        counts = {k: len(t) for k, t in zip(names, tensors(x))}
        # as many tensors as labels, of other row counts than the labels': the samples themselves
        one_each = y is not None and len(counts) == len(y) and set(counts.values()) != {len(y)}
        listed = not isinstance(x, Mapping) and len(counts) > _MANY_INPUTS
        if listed and (len(set(counts.values())) > 1 or one_each):
            lengths = sorted(counts.values())
            ragged = lengths[0] != lengths[-1]
            rows_of = f"{lengths[0]} to {lengths[-1]} rows" if ragged else f"{lengths[0]} rows each"
            raise DataContractError(
                f"dataset '{ref}': {split}_x is a list of {len(counts)} tensors of {rows_of}: "
                "a list or tuple is read as the model's inputs, one per forward() argument, not as samples",
                hint="stack the samples into one tensor per input: pad them to one length "
                "(torch.nn.utils.rnn.pad_sequence(samples, batch_first=True)), give their lengths as a second input "
                "if forward() needs them, and name the padded axis in signature.dynamic_axes"
                if ragged
                else "stack the samples into one tensor per input (torch.stack(samples))",
            )
        if len(set(counts.values())) > 1:
            raise DataContractError(
                f"dataset '{ref}': the inputs of {split}_x have different row counts {counts} (axis 0 of every "
                "input is the batch)",
                hint=_rows_hint(dict(zip(names, tensors(x)))),
            )
        if rows(x) == 0:
            raise DataContractError(f"dataset '{ref}': {split}_x holds no samples", hint=_EMPTY_HINTS[split])
        if y is not None and (len(y) != rows(x) or y.ndim < 1):
            raise DataContractError(
                f"dataset '{ref}': {split}_x has {rows(x)} rows but {split}_y has shape "
                f"{list(y.shape)} (one label per row expected)",
                hint=_label_rows_hint(x, y, split),
            )
        if y is not None:
            _check_labels(y, split, data.num_classes, ref)
        _check_values(x, y, split, ref)
    if (data.train_y is None) != (data.val_y is None):
        raise DataContractError(
            f"dataset '{ref}' gives labels for one split only", hint="give both train_y and val_y, or neither (None)"
        )
    tx, vx = data.train_x, data.val_x
    if _form(tx) != _form(vx) or _keys(tx) != _keys(vx):
        raise DataContractError(
            f"dataset '{ref}': train_x is {_describe(tx)} but val_x is {_describe(vx)}",
            hint="structure train_x and val_x the same way (the same tensor, tuple or dict keys)",
        )
    names = _keys(vx)
    _check_dynamic_axes(vx, dynamic or {}, ref)
    for split, x in (("train_x", tx), ("val_x", vx)):
        check_tied_sizes(x, names, dynamic or {}, f"dataset '{ref}' {split}")
    for name, a, b in zip(names, tensors(tx), tensors(vx)):
        which = "" if is_tensor(vx) else f"input '{name}': "
        if a.dtype != b.dtype:
            raise DataContractError(
                f"dataset '{ref}': {which}train_x is {a.dtype} but val_x is {b.dtype}",
                hint=f"give both splits the same dtype (e.g. val_x{_item(vx, name)}.to({a.dtype}))",
            )
        free = {int(axis) for axis in (dynamic or {}).get(name, {})}
        differ = [i + 1 for i, (p, q) in enumerate(zip(a.shape[1:], b.shape[1:])) if p != q and i + 1 not in free]
        if a.dim() != b.dim() or differ:
            raise DataContractError(
                f"dataset '{ref}': {which}validation samples are {list(b.shape[1:])} but training samples are "
                f"{list(a.shape[1:])}{_unknown_axes_note(vx, dynamic or {})}",
                hint=_shape_hint(vx, name, differ, dynamic or {}),
            )


def _label_rows_hint(x: Inputs, y: torch.Tensor, split: str) -> str:
    """The fix for labels of another row count than the inputs. Labels per node, position or frame ``[N]`` beside
    inputs given as one sample ``[1, N, ...]`` (a graph as a batch of one) lack that sample's axis: ``y[None]``."""
    if y.ndim >= 1 and rows(x) == 1 and any(t.ndim >= 2 and t.shape[1] == len(y) for t in tensors(x)):
        return (
            f"{split}_x is one sample of {len(y)} positions (axis 1): give its labels that sample's axis too, "
            f"{split}_y[None] (labels {[1, *y.shape]})"
        )
    return "give one label per sample"


def _rows_hint(inputs: Mapping[str, torch.Tensor]) -> str:
    """The fix for inputs of different row counts. Where two read as an ``nn.EmbeddingBag``'s flat ids and their
    offsets (:func:`_flat_bags`), those have no batch axis at all: the padded form has one. Where one holds indices
    into another's rows (a graph's edges into its nodes, :func:`_indexes_rows`), they are one sample: a batch of one.
    An input whose axis 1 is another's row count reads as an RNN state, given batch-first."""
    bags = _flat_bags(inputs)
    if bags is not None:
        return (
            f"{bags[0]} and {bags[1]} read as an nn.EmbeddingBag's flat ids and offsets, which have no batch axis: "
            "give each sample's ids padded to one length instead, one row per sample ([N, L], "
            "torch.nn.utils.rnn.pad_sequence(bags, batch_first=True, padding_value=PAD)), and build the "
            "nn.EmbeddingBag with padding_idx=PAD, which leaves the pads out of each bag"
        )
    one = batch_of_one_hint([TensorSpec(name=n, shape=list(t.shape), dtype=str(t.dtype)) for n, t in inputs.items()])
    if _indexes_rows(inputs):
        return one
    if _batch_on_axis_1(inputs):
        return (
            "give every input one row per sample on axis 0; an input whose batch is another axis (an RNN's state "
            "[layers, batch, hidden]) is given batch-first and forward() moves it (h0.transpose(0, 1))"
        )
    return f"give every input one row per sample on axis 0, or, where they are one sample without a batch axis, {one}"


def _indexes_rows(inputs: Mapping[str, torch.Tensor]) -> bool:
    """Whether an integer input of a small fixed axis 0 (a graph's edge_index ``[2, edges]``) holds indices into the
    rows of another input (its nodes ``[nodes, F]``): one sample without a batch axis, not samples of two counts."""
    for name, t in inputs.items():
        if t.ndim < 2 or len(t) > 3 or not t.numel() or not _integers(t) or int(t.min()) < 0:
            continue
        top = int(t.max())
        if any(n != name and len(u) != len(t) and top < len(u) for n, u in inputs.items()):
            return True
    return False


def _batch_on_axis_1(inputs: Mapping[str, torch.Tensor]) -> bool:
    """Whether an input's axis 1 is the row count of another (an RNN's state ``[layers, batch, hidden]``): the
    batch is there, moved to axis 0 in forward()."""
    return any(
        t.ndim >= 2 and len(t) != len(u) and t.shape[1] == len(u)
        for n, t in inputs.items()
        for m, u in inputs.items()
        if n != m
    )


def _flat_bags(inputs: Mapping[str, torch.Tensor]) -> tuple[str, str] | None:
    """The names of the flat ids and the offsets of bags laid end to end, where two inputs look like them: 1-D
    integers both, the offsets non-decreasing from 0 and pointing within the ids, which are of another length."""
    flat = {name: t for name, t in inputs.items() if t.ndim == 1 and len(t) and _integers(t)}
    for name, offsets in flat.items():
        if int(offsets[0]) != 0 or not bool((offsets[1:] >= offsets[:-1]).all()):
            continue
        ids = next((n for n, t in flat.items() if len(t) != len(offsets) and len(t) >= int(offsets[-1])), None)
        if ids is not None:
            return ids, name
    return None


def _integers(t: torch.Tensor) -> bool:
    import torch

    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def _labels_hint(y: Any, samples: int) -> str:
    """The fix for labels that are no tensor: a list of one tensor per sample (as many as the ``samples`` rows, or
    of lengths that differ: CTC transcripts) is padded into one with -100, which the losses ignore; targets in parts
    (a detector's ``{hm, wh, reg}``, tensors already) are packed into one, which batching, training and validation
    carry as one; a list of one dict per sample (a Hugging Face detector's ``{class_labels, boxes}``) is laid into
    one tensor; anything else is an array to wrap."""
    parts = list(y.values()) if isinstance(y, Mapping) else y if isinstance(y, (tuple, list)) else []
    if parts and not isinstance(y, Mapping) and all(isinstance(p, Mapping) for p in parts):
        return _dicts_hint(parts)
    if parts and all(is_tensor(t) for t in parts):
        per_sample = _per_sample(parts, samples) if isinstance(y, (tuple, list)) else None
        if per_sample is not None:
            return per_sample
        return (
            "pack the targets into one tensor, one row per sample (torch.cat along a channel axis, or torch.stack "
            "along a new axis), and split them again in train.loss (targets[:, :C] for the first C channels)"
        )
    return "wrap arrays with torch.from_numpy(...), or give None for no labels"


def _dicts_hint(parts: list[Mapping[str, Any]]) -> str:
    """The fix for labels given as one dict of tensors per sample: with boxes, the ``[N, M, 5]`` rows of (class, x1,
    y1, x2, y2) that ``validate.metric: detection_recall`` reads, padded with class -1; otherwise one tensor."""
    keys = {str(k) for p in parts for k in p}
    if any("box" in k.lower() for k in keys):
        return (
            "pad the per-image labels into one tensor [N, M, 5] of (class, x1, y1, x2, y2) rows, M the most boxes of "
            "an image, class -1 for padding rows, which validate.metric: detection_recall reads (boxes as x1, y1, "
            "x2, y2 in the units the model predicts; convert (cx, cy, w, h) ones), and turn them back into dicts in "
            "train.loss"
        )
    return (
        "stack the per-sample dicts into one tensor, one row per sample (torch.stack of each sample's values), and "
        "split them again in train.loss"
    )


def _per_sample(parts: list[Any], samples: int) -> str | None:
    """The fix for labels given as a list of tensors, one per sample (``samples`` of them, or of lengths that
    differ), as one tensor of a row per sample; None where they read as the parts of one target."""
    lengths = {len(t) for t in parts if t.ndim}
    if len(parts) != samples and len(lengths) < 2:
        return None
    if any(t.ndim == 0 for t in parts):
        return "give the labels as one tensor, one row per sample: torch.stack(labels)"
    return (
        f"give the labels as one tensor, one row per sample, padded to one length with {IGNORE_LABEL}, which the loss "
        f"ignores: torch.nn.utils.rnn.pad_sequence(labels, batch_first=True, padding_value={IGNORE_LABEL})"
    )


def _item(x: Inputs, name: str) -> str:
    """How code reaches input ``name`` of ``x``: ``['ids']``, ``[1]``, or nothing for a bare tensor."""
    if is_tensor(x):
        return ""
    return f"[{name!r}]" if isinstance(x, Mapping) else f"[{name}]"


def _unknown_names(x: Inputs, dynamic: Mapping[str, Any]) -> list[str]:
    """The keys of ``signature.dynamic_axes`` that name no input of ``x``, where the data fixes the input names (a
    bare tensor is ``input``, a dict names its own; a tuple's names are the model's forward parameters)."""
    if not (is_tensor(x) or isinstance(x, Mapping)):
        return []
    return sorted(set(dynamic) - set(_keys(x)))


def _unknown_axes_note(x: Inputs, dynamic: Mapping[str, Any]) -> str:
    """For a shape error: the axes declared under a name the data does not have, which free no axis of it."""
    unknown = _unknown_names(x, dynamic)
    if not unknown:
        return ""
    names = ", ".join(f"'{n}'" for n in unknown)
    return f"; signature.dynamic_axes names {names}, not an input of the data (its inputs: {_keys(x)})"


def _shape_hint(x: Inputs, name: str, differ: list[int], dynamic: Mapping[str, Any]) -> str:
    """The fix for samples of another shape in each split: declare the varying axis under the input's own name,
    or, where the axes are declared under a name the data lacks, key them by the data's names."""
    unknown = _unknown_names(x, dynamic)
    if unknown and is_tensor(x):
        axes = ", ".join(f"{axis}: {label}" for axis, label in dict(dynamic[unknown[0]]).items())
        return (
            f"key signature.dynamic_axes by '{name}' (data given as one tensor is the input '{name}': "
            f"{{{name}: {{{axes}}}}}), or give the data as a dict {{'{unknown[0]}': tensor}}"
        )
    if not (is_tensor(x) or isinstance(x, Mapping)):  # a tuple's inputs are named by forward(), which data lacks
        return (
            "give train_x and val_x as dicts keyed by forward()'s parameter names, the names signature.dynamic_axes "
            "takes (a tuple's inputs have no names until the model is called), and declare the axis that varies "
            f"there, e.g. {{<name>: {{{differ[0] if differ else 1}: seq}}}}"
        )
    if unknown:
        return f"key signature.dynamic_axes by the data's input names {_keys(x)}"
    return (
        "give both splits the same per-sample shape, or declare the axis that varies in signature.dynamic_axes "
        f"(e.g. {{{name}: {{{differ[0] if differ else 1}: seq}}}})"
    )


def _check_labels(y: torch.Tensor, split: str, num_classes: int, ref: str) -> None:
    """Integer labels are classes 0..num_classes-1, one per row ([N]) or one per position ([N, S] token labels,
    [N, H, W] pixel labels; ``IGNORE_LABEL`` marks a row or position without one, as torch's cross-entropy and
    Kiln's accuracy read it: kiln.core.labels); float targets may have any shape."""
    import torch

    if y.dtype.is_floating_point:
        return
    if y.dtype.is_complex or y.dtype == torch.bool:
        raise DataContractError(
            f"dataset '{ref}': {split}_y is {y.dtype}{list(y.shape)}, neither integer class labels nor float targets",
            hint="give int64 labels ([N], or [N, ...] one per position) or float targets",
        )
    if not isinstance(num_classes, int) or num_classes < 1:
        said = "is not given" if num_classes in (0, None) else f"is {num_classes!r}, not a positive integer"
        raise DataContractError(
            f"dataset '{ref}': integer labels but num_classes {said}",
            hint="pass num_classes=... to DatasetSplits (or float targets for regression); labels that are group ids "
            "for a train.loss of yours (a contrastive loss's positives) take num_classes = the number of groups",
        )
    dense = y.ndim > 1
    given = y[y != IGNORE_LABEL]
    if not given.numel():  # nothing to train on or to measure accuracy with; never a run that says it passed
        raise DataContractError(
            f"dataset '{ref}': every label of {split}_y is {IGNORE_LABEL} (no row or position has a label)",
            hint=f"label some {'positions' if dense else 'rows'} of {split}_y, or give None for no labels",
        )
    if given.numel() and (int(given.min()) < 0 or int(given.max()) >= num_classes):
        if _integer_boxes(y, num_classes):
            raise _integer_boxes_error(y, split, num_classes, ref)
        if _packed_targets(y, num_classes):
            raise _packed_targets_error(y, split, num_classes, ref)
        raise _out_of_range(given, split, num_classes, ref, dense)


def _integer_boxes(y: torch.Tensor, num_classes: int) -> bool:
    """Integer ``[N, M, 5]`` labels whose column 0 holds classes (or a negative padding mark) and whose columns 1-4
    do not: a detector's (class, x1, y1, x2, y2) in pixels, which integer labels cannot be, since Kiln reads integer
    labels as class ids at every position (cross-entropy, accuracy)."""
    if y.ndim != 3 or y.shape[-1] != 5 or not y.numel():
        return False
    boxes = y[..., 1:]
    return int(y[..., 0].max()) < num_classes and bool(((boxes < 0) | (boxes >= num_classes)).any())


def _integer_boxes_error(y: torch.Tensor, split: str, num_classes: int, ref: str) -> DataContractError:
    """The error for integer detection labels (:func:`_integer_boxes`): they are given as float, the dtype of
    targets that are not all class ids, which ``detection_recall`` and a ``train.loss`` of yours split again."""
    boxes = y[..., 1:]
    return DataContractError(
        f"dataset '{ref}': {split}_y is {str(y.dtype).removeprefix('torch.')}{list(y.shape)}, detection labels "
        f"(class, x1, y1, x2, y2) with box coordinates from {int(boxes.min())} to {int(boxes.max())}; integer labels "
        f"are read as class ids at every position, 0..{num_classes - 1} (num_classes {num_classes})",
        hint=f"give detection labels as float: {split}_y.float() (detection_recall and your train.loss read "
        "column 0 as the class, a negative class marking padding, and columns 1-4 as the box in the labels' units)",
    )


def _packed_targets(y: torch.Tensor, num_classes: int) -> bool:
    """Integer ``[N, K]`` labels (K > 1) whose column 0 holds classes and whose other columns hold several values
    outside them: most likely several targets a sample packed in one tensor (a class, an age, attributes), not a
    class per position. One value outside the classes is left to :func:`_ignore_value` (a dataset's ignore mark)."""
    if y.ndim != 2 or y.shape[1] < 2 or not y.numel():
        return False
    first, rest = y[:, 0], y[:, 1:]
    outside = rest[(rest != IGNORE_LABEL) & ((rest < 0) | (rest >= num_classes))]
    in_range = bool(((first == IGNORE_LABEL) | ((first >= 0) & (first < num_classes))).all())
    return in_range and len(outside.unique()) > 1


def _packed_targets_error(y: torch.Tensor, split: str, num_classes: int, ref: str) -> DataContractError:
    """The error for integer labels that look like several targets a sample (:func:`_packed_targets`): integer
    labels are read as class ids at every position (cross-entropy, accuracy), so targets beside the class go in one
    float tensor, which a ``train.loss`` and ``validate.metric`` of the user's split again."""
    rest = y[:, 1:]
    columns = "column 1" if y.shape[1] == 2 else f"columns 1-{y.shape[1] - 1}"
    return DataContractError(
        f"dataset '{ref}': {split}_y is {str(y.dtype).removeprefix('torch.')}{list(y.shape)}: column 0 holds "
        f"classes 0..{num_classes - 1}, {columns} values from {int(rest.min())} to "
        f"{int(rest.max())}, outside them (num_classes {num_classes}); integer labels are read as class ids at every "
        "position",
        hint="if these are several targets a sample, give them as one float tensor, one row per sample: "
        "torch.cat([cls[:, None].float(), age[:, None], attrs], 1), split again in your train.loss "
        "(targets[:, 0].long(), targets[:, 1:]) and validate.metric; if they are class ids per position, fix the "
        "labels or num_classes",
    )


def _ignore_value(given: torch.Tensor, num_classes: int) -> tuple[int, int] | None:
    """The one label value outside 0..num_classes-1 among labels per position that also hold classes, and how many
    positions hold it: a dataset's own mark for "no label" (VOC's and Cityscapes' 255), which Kiln spells
    ``IGNORE_LABEL``. None where several values are out of range, or every label is that one value."""
    outside = given[(given < 0) | (given >= num_classes)]
    value = int(outside[0])
    if not bool((outside == value).all()) or len(outside) == len(given):
        return None
    return value, len(outside)


def _out_of_range(given: torch.Tensor, split: str, num_classes: int, ref: str, dense: bool) -> DataContractError:
    """The error for labels outside 0..num_classes-1 (``given``: those that are not ``IGNORE_LABEL``). One value
    out of range among labels per position is most likely the dataset's ignore value: the fix maps it to
    ``IGNORE_LABEL`` (raising num_classes past it would train classes that never occur)."""
    found = _ignore_value(given, num_classes) if dense else None
    message = (
        f"dataset '{ref}': {split}_y has labels from {int(given.min())} to {int(given.max())}, "
        f"outside 0..{num_classes - 1} (num_classes {num_classes})"
    )
    if found is None:
        marks = f"; {IGNORE_LABEL} marks a position without a label" if dense else ""
        return DataContractError(message + marks, hint="fix the labels or num_classes")
    value, count = found
    class_too = f", or set num_classes to {value + 1} if {value} is a class" if value == num_classes else ""
    return DataContractError(
        f"{message}: {count:,} positions hold {value}, the only label outside 0..{num_classes - 1}; "
        f"{IGNORE_LABEL} marks a position without a label",
        hint=f"if {value} marks positions without a label, map it to {IGNORE_LABEL}: y[y == {value}] = "
        f"{IGNORE_LABEL} (cross-entropy ignores {IGNORE_LABEL} by default; a train.loss with "
        f"ignore_index={value} then takes ignore_index={IGNORE_LABEL}){class_too}",
    )


def _check_values(x: Inputs, y: torch.Tensor | None, split: str, ref: str) -> None:
    """Inputs of a type a model can take (real numbers or booleans), and no NaN or infinity in float inputs or
    targets: a NaN would otherwise skip every training step or fail a gate as if the engine were wrong."""
    for key, t in zip(_keys(x), tensors(x)):
        where = f"{split}_x" + ("" if is_tensor(x) else f"[{key!r}]" if isinstance(x, Mapping) else f"[{key}]")
        if t.dtype.is_complex:
            raise DataContractError(
                f"dataset '{ref}' gives {where} as {t.dtype}: complex inputs cannot be exported or run",
                hint="give real inputs (e.g. the real and imaginary parts as two channels)",
            )
        _check_finite(t, where, ref)
    if y is not None and y.dtype.is_floating_point:
        _check_finite(y, f"{split}_y", ref)


def _check_finite(t: torch.Tensor, where: str, ref: str) -> None:
    if not t.dtype.is_floating_point:
        return
    nan, inf = int(t.isnan().sum()), int(t.isinf().sum())
    if inf and not nan and _additive_mask(t):
        raise DataContractError(
            f"dataset '{ref}': {where} holds only 0 and -inf ({inf} values -inf): an additive attention mask, whose "
            "-inf Kiln refuses as any infinite input (calibration ranges and the gates' errors need finite values)",
            hint=f"give {where} as a bool mask (True where masked, as nn.MultiheadAttention reads one), or fill it "
            "with a large finite negative number in place of -inf: -1e9, or torch.finfo(dtype).min "
            "(mask.masked_fill(mask.isinf(), -1e9))",
        )
    if nan or inf:
        counts = " and ".join(s for s in (f"{nan} NaN" if nan else "", f"{inf} infinite" if inf else "") if s)
        raise DataContractError(
            f"dataset '{ref}': {where} holds {counts} values",
            hint="clean or drop those samples in the dataset function (e.g. torch.nan_to_num, or a mask)",
        )


def _additive_mask(t: torch.Tensor) -> bool:
    """Whether ``t`` holds nothing but 0 and -inf: an additive attention mask (scores plus the mask)."""
    return bool(((t == 0) | (t == float("-inf"))).all())


def _check_dynamic_axes(x: Inputs, dynamic: Mapping[str, Mapping[int, str]], ref: str) -> None:
    """Each axis of signature.dynamic_axes exists in the input it names (axis 0, the batch, is not one of them)."""
    ranks = {name: t.dim() for name, t in zip(_keys(x), tensors(x))}
    for name, axes in dynamic.items():
        rank = ranks.get(name)
        for axis in axes:
            if rank == 1:
                raise DataContractError(
                    f"signature.dynamic_axes gives input '{name}' axis {axis}, but dataset '{ref}' gives '{name}' "
                    "only the batch axis (axis 0)",
                    hint=f"remove '{name}' from signature.dynamic_axes (signature.batch_sizes sizes the batch axis)",
                )
            if rank is not None and not 1 <= int(axis) < rank:
                raise DataContractError(
                    f"signature.dynamic_axes gives input '{name}' axis {axis}, but dataset '{ref}' gives it "
                    f"{rank} axes (0 is the batch; 1..{rank - 1} may vary)",
                    hint=f"name an axis from 1 to {rank - 1} of '{name}' in signature.dynamic_axes",
                )


# Without training, train_x still feeds the calibration and the export's example: a user who trains elsewhere
# leaves it out, and the fix says what to give
_TRAIN_X_HINT = (
    "give train_x samples even with training off (train.enabled: false): the calibration and the export read them; "
    "your validation inputs will do (train_x = val_x, train_y = val_y)"
)
_EMPTY_HINTS = {"train": _TRAIN_X_HINT, "val": "give val_x samples: the checks of every engine run on them"}


def _check_x(x: Any, field: str, ref: str) -> None:
    if x is None and field == "train_x":
        raise DataContractError(f"dataset '{ref}' gives train_x as None", hint=_TRAIN_X_HINT)
    items = (
        [x]
        if is_tensor(x)
        else list(x.values())
        if isinstance(x, Mapping)
        else list(x)
        if isinstance(x, tuple)
        else None
    )
    if not items:
        raise DataContractError(
            f"dataset '{ref}' gives {field} as {type(x).__name__}"
            + (" with nothing in it" if items == [] else "")
            + ", not a torch.Tensor, a tuple (or list) of tensors or a dict of named tensors",
            hint="wrap arrays with torch.from_numpy(...) in the dataset function",
        )
    for key, t in zip(_keys(x) if items else [], items):
        at = f"[{key!r}]" if isinstance(x, Mapping) else f"[{key}]"
        if _nested_tensors(t):
            raise _nested_input(t, field, key, ref)
        if not is_tensor(t):
            raise DataContractError(
                f"dataset '{ref}' gives {field}{at} as {type(t).__name__}, not a torch.Tensor",
                hint="wrap arrays with torch.from_numpy(...) in the dataset function",
            )
        if t.dim() == 0:
            raise DataContractError(
                f"dataset '{ref}' gives {field}{at} as a scalar; inputs need a batch axis",
                hint="stack the samples along axis 0",
            )


def _nested_tensors(t: Any) -> bool:
    """Whether an input is a tuple, list or dict holding tensors (at any depth): a nested input such as Hugging
    Face's ``past_key_values``, ``((k0, v0), (k1, v1))``."""
    if isinstance(t, Mapping):
        t = list(t.values())
    if not isinstance(t, (tuple, list)) or not t:
        return False
    return all(is_tensor(i) or _nested_tensors(i) for i in t)


def _nested_input(t: Any, field: str, key: str, ref: str) -> DataContractError:
    """The error for a nested input: the graph's inputs are flat tensors, each with a name of its own, so the
    structure is rebuilt inside the model's forward. A KV cache's pairs are named as Hugging Face's exports name
    them (``past_key_0``, ``past_value_0``)."""
    kind = "dict" if isinstance(t, Mapping) else type(t).__name__
    pairs = isinstance(t, (tuple, list)) and all(isinstance(i, (tuple, list)) and len(i) == 2 for i in t)
    example = (
        f"past_key_0, past_value_0, past_key_1, ... and in forward: {key} = ((past_key_0, past_value_0), ...)"
        if pairs
        else f"{key}_0, {key}_1, ... and in forward: {key} = ({key}_0, {key}_1, ...)"
    )
    return DataContractError(
        f"dataset '{ref}' gives {field}[{key!r}] as a nested {kind} of tensors: nested inputs are not supported "
        "(each graph input is one named tensor)",
        hint=f"give each tensor as an input of its own, named in a dict {field} ({example}); a wrapper module's "
        "forward can take them and rebuild the structure for the model",
    )


def _form(x: Inputs) -> str:
    return "tensor" if is_tensor(x) else "dict" if isinstance(x, Mapping) else "tuple"


def _describe(x: Inputs) -> str:
    if is_tensor(x):
        return "a tensor"
    if isinstance(x, Mapping):
        return f"a dict with keys {list(x)}"
    return f"a tuple of {len(x)} tensors"


def check_forward_takes(model: Any, x: Inputs, ref: str) -> None:
    """A dict key the forward does not take, or more tuple items than it takes: a clear error, not a TypeError. A
    forward with ``**kwargs`` takes any key; the export warns of one its graph never reads
    (:mod:`kiln.stages.export.graph_inputs`)."""
    params = _forward_params(model)
    if not params or any(p.kind == p.VAR_KEYWORD for p in params) and isinstance(x, Mapping):
        return
    if not isinstance(x, Mapping) and _keywords_only(params):
        raise DataContractError(
            f"model '{ref}' forward({_signature(params)}) takes keyword arguments only, and the dataset gives "
            f"{_describe(x)}, which is passed by position",
            hint="return the inputs as a dict {name: tensor} from the data function (train_x and val_x), keyed by "
            "the names forward() reads",
        )
    if isinstance(x, Mapping):
        known = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        unknown = [k for k in x if k not in known]
        if unknown and not known and any(p.kind == p.VAR_POSITIONAL for p in params):
            raise DataContractError(
                f"model '{ref}' forward({_signature(params)}) takes positional arguments only, and the dataset "
                f"gives {_describe(x)}, which is passed by keyword",
                hint="return the inputs as a tuple from the data function (train_x and val_x), one tensor per "
                "argument in the order forward() reads them",
            )
        if unknown:
            raise DataContractError(
                f"model '{ref}' forward({_signature(params)}) takes no "
                f"argument {unknown[0]!r}, which the dataset's inputs name",
                hint=f"name the data's dict keys after the forward's parameters {sorted(known)}",
            )
    elif isinstance(x, tuple) and not any(p.kind == p.VAR_POSITIONAL for p in params):
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if len(x) > len(positional):
            raise DataContractError(
                f"model '{ref}' forward takes {len(positional)} positional inputs, the dataset "
                f"gives a tuple of {len(x)}",
                hint="give x as a tuple with one tensor per forward parameter, or a dict",
            )


def _signature(params: list[inspect.Parameter]) -> str:
    """The forward's parameters as its ``def`` writes them: ``*args`` and ``**kwargs`` with their stars."""
    return ", ".join({"VAR_POSITIONAL": "*", "VAR_KEYWORD": "**"}.get(p.kind.name, "") + p.name for p in params)


def _keywords_only(params: list[inspect.Parameter]) -> bool:
    """A forward that takes no input by position (``forward(self, **batch)``, ``forward(self, *, x)``): a bare
    tensor or a tuple of inputs cannot reach it."""
    by_position = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return not any(p.kind in by_position or p.kind == p.VAR_POSITIONAL for p in params)


def integer_ranges(
    data: DatasetSplits, names: list[str], columns: Mapping[str, int] | None = None
) -> dict[str, IntRange]:
    """Input name -> [smallest, largest] value in the data, for each integer input: values the model's embeddings and
    index lookups are known to take (a categorical feature with 10 levels fails at 10): the optimizer's safety net
    draws its random integers there, and the engines take the negative indices the data holds. An input in
    ``columns`` (name -> the cells of last axes the graph fixes, :func:`fixed_columns`) whose cells hold different
    ranges gets one [smallest, largest] per cell instead, flattened (categorical features packed in one input,
    each column indexing a table of its own size: the widest column's range runs past the others' tables; DLRM's
    ``[batch, tables, ids]``, a table's ids in each row of cells); one whose last axis is dynamic (token ids along a
    sequence) keeps one range."""
    lows: dict[str, np.ndarray] = {}
    highs: dict[str, np.ndarray] = {}
    for x in (data.train_x, data.val_x):
        if not rows(x):
            continue
        for name, values in feed_for_graph(x, names).items():
            if values.dtype.kind not in "iu" or not values.size:
                continue
            n = (columns or {}).get(name)
            flat = values.reshape(-1, n) if n and trailing_axes(values.shape, n) else values.reshape(-1, 1)
            low, high = flat.min(0), flat.max(0)
            if name in lows and lows[name].shape != low.shape:  # splits of other widths: one range over both
                low, high = low.min(keepdims=True), high.max(keepdims=True)
                lows[name], highs[name] = lows[name].min(keepdims=True), highs[name].max(keepdims=True)
            lows[name] = np.minimum(low, lows.get(name, low))
            highs[name] = np.maximum(high, highs.get(name, high))
    out: dict[str, IntRange] = {}
    for name, low in lows.items():
        pairs = [[int(lo), int(hi)] for lo, hi in zip(low, highs[name])]
        out[name] = pairs if len({tuple(p) for p in pairs}) > 1 else [int(low.min()), int(highs[name].max())]
    return out


def value_ranges(data: DatasetSplits, names: list[str]) -> dict[str, list[float]]:
    """Input name -> [smallest, largest] finite value in the data, for each float input (:func:`float_ranges` over
    the training and validation splits): recorded in each engine's ``kiln-engine.json`` so that ``kiln validate
    ENGINE`` without ``--inputs`` draws its random values where the engine was calibrated (images in [0, 1]), not
    from N(0, 1)."""
    out: dict[str, list[float]] = {}
    for x in (data.train_x, data.val_x):
        if not rows(x):
            continue
        for name, (low, high) in float_ranges(feed_for_graph(x, names)).items():
            old_low, old_high = out.get(name, (low, high))
            out[name] = [min(low, old_low), max(high, old_high)]
    return out


def fixed_columns(specs: list[TensorSpec], tables: Mapping[str, Any] | None = None) -> dict[str, int]:
    """Input name -> the number of cells of its last axes the graph fixes (past the first, the batch: ``[batch, 4,
    3]`` has 12, ``[batch, seq, 3]`` 3), for each input (graph ``TensorSpec``) of two or more axes whose last axis
    the graph fixes: the inputs whose cells :func:`integer_ranges` may range one by one. ``tables``: the graph's
    index ranges (:func:`kiln.core.onnx_io.index_ranges`), where given only an input with a range per column or cell
    there (ids packed for tables of their own, columns shifted into one shared table) takes as many cells: token
    ids of a fixed length keep one range, so the safety net draws every position from all the ids the data holds,
    not the first only from its start token, and so does an input the graph gives no range (an image's uint8
    pixels would take one range per pixel)."""
    out = {}
    for spec in specs:
        bounds = None if tables is None else tables.get(spec.name)
        cells = _fixed_cells(spec.shape[1:])
        if cells and tables is None:
            out[spec.name] = cells
        elif cells and _per_column(bounds):
            out[spec.name] = len(bounds)
    return out


def _fixed_cells(dims: list[int | str]) -> int:
    """The number of cells of the last of ``dims`` that are fixed (sizes, not names); 0 where the last is not."""
    cells = 0
    for dim in reversed(dims):
        if not isinstance(dim, int) or dim < 1:
            break
        cells = (cells or 1) * dim
    return cells


def _per_column(bounds: Any) -> bool:
    return isinstance(bounds, list) and bool(bounds) and isinstance(bounds[0], list)
