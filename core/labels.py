"""Integer labels: one per row (classification) or one per position (a label per token for named-entity tagging,
per pixel for segmentation), where ``IGNORE_LABEL`` marks a position that carries none (padding, sub-word pieces).

Per-position labels have the logits' shape without the class axis (:func:`kiln.core.compare.class_axis`: the last
for ``[N, S, C]``, axis 1 for ``[N, C, H, W]``). Losses and accuracies average over the labelled positions only,
as Hugging Face's token-classification models and torch's ``cross_entropy(ignore_index=-100)`` do.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from kiln.core.compare import class_axis

Axes = Mapping[str, Mapping[int, str]]  # input or output -> {axis: name}
IGNORE_LABEL = -100  # torch's cross_entropy default ignore_index, and what Hugging Face pads token labels with


# The label arguments of Hugging Face's heads, given which the model returns its loss: ``labels`` (and ``mc_labels``,
# ``next_sentence_label``: the suffixes), a question answerer's ``start_positions``/``end_positions``, the
# forecasters' ``future_values`` (PatchTST, Informer, Autoformer, TimesFM) and the regressors' ``target_values``
LABEL_NAMES = {
    "label",
    "labels",
    "target",
    "targets",
    "start_positions",
    "end_positions",
    "future_values",
    "target_values",
}


def is_label_name(name: str) -> bool:
    """Named like the labels a model computes its loss from (``labels``, ``targets``, ``mc_labels``...)."""
    low = name.lower()
    return low in LABEL_NAMES or low.endswith(("_label", "_labels"))


def is_loss_name(name: str) -> bool:
    """Named like Hugging Face's ``ModelOutput.loss`` (a nested output's too, ``output.loss``): the output a model
    returns only where it is given its labels."""
    return name.rsplit(".", 1)[-1].lower() == "loss"


def floating(y: Any) -> bool:
    """A torch tensor's or a numpy array's dtype is a float one."""
    return y.dtype.is_floating_point if hasattr(y.dtype, "is_floating_point") else np.issubdtype(y.dtype, np.floating)


def per_position(y: Any) -> bool:
    """Integer labels with more than one axis: one per position of each row, or several targets per sample (a
    multi-task model's ``[N, 2]``); :func:`follows_positions` tells which where the model's outputs or inputs are
    known."""
    return y.ndim > 1 and not floating(y)


def follows_positions(
    y: Any, logits: Any | None = None, outputs: Iterable[Any] = (), sizes: Iterable[int] = ()
) -> bool:
    """Whether integer labels ``y`` with more than one axis are labels per position (a tag per token, a class per
    pixel), not several targets per sample (a multi-task model's topic and sentiment classes, ``[N, 2]``, which
    train.loss and validate.metric split). Such targets come one row per sample, so labels of three axes and more
    are labels per position; labels ``[N, K]`` are where axis 1 follows a position axis of the model: the class
    logits ``logits`` have one more axis than the labels (their class axis, ``[N, T, C]``; a sequence's targets of
    another length too) or more rows (positions flattened, ``[N * T, C]``); or an output with more axes than the
    labels has an axis ``K`` long between the batch and its last axis (hidden states ``[N, T, H]`` beside pooled
    logits ``[N, C]``; not a feature or class axis); or an input has an axis ``K`` long (``sizes``: the inputs'
    sizes besides the batch)."""
    if not per_position(y):
        return False
    if y.ndim > 2 or logits is not None and (logits.ndim == y.ndim + 1 or len(logits) > len(y)):
        return True
    size = y.shape[1]
    return size in set(sizes) or any(o.ndim > y.ndim and size in tuple(o.shape[1:-1]) for o in outputs)


def follows_output(y: Any, own: Mapping[str, Any], others: Iterable[Mapping[str, Any]]) -> str | None:
    """The output float targets ``y`` are values per position of (an image-to-image model's ``[N, 3, 2H, 2W]``, a
    sequence regression's ``[N, T]``), or None: one of the targets' rank and, past the batch axis, their shape in
    ``own`` (the model's outputs on the inputs at the data's own sizes) whose shape differs in one of ``others``
    (its outputs at other sizes), so that its axes follow the inputs'. Such targets, like integer labels per
    position (:func:`follows_positions`), fit the data's own sizes only: a cut or repeated image is targeted by no
    array of them."""
    if y is None or y.ndim < 2 or not floating(y):
        return None
    others = list(others)
    for name, out in own.items():
        shape = tuple(np.shape(out)[1:])
        if np.ndim(out) != y.ndim or shape != tuple(y.shape[1:]):
            continue
        if any(name in o and tuple(np.shape(o[name])[1:]) != shape for o in others):
            return name
    return None


def copied_input(inputs: Mapping[str, Any], y: Any) -> str | None:
    """The integer input equal to the labels per position ``y`` at every labelled position, or None. Kiln scores the
    logits at position t against the label at t, so labels that repeat an input (Hugging Face's causal-LM ``labels =
    input_ids``, which its model shifts itself) train a model to copy it. Labels of one value throughout say nothing
    of a copy, and are not matched; nor is an input named like labels (:func:`is_label_name`): that is the labels
    given twice, not a model taught to copy."""
    if not per_position(y):
        return None
    keep = y != IGNORE_LABEL
    given = y[keep]
    if given.numel() == 0 or not bool((given != given[0]).any()):
        return None
    for name, t in inputs.items():
        if is_label_name(name) or tuple(t.shape) != tuple(y.shape) or floating(t):
            continue
        if bool((t[keep] == given).all()):
            return name
    return None


def is_mask_name(name: str) -> bool:
    """Named like a mask over positions: a Hugging Face attention mask (``attention_mask``,
    ``decoder_attention_mask``) or a node mask (:func:`is_node_mask_name`), where 0 marks padding, or a padding mask
    (:func:`is_padding_mask_name`), where True or 1 does. :func:`pad_positions` reads either."""
    return name.lower().endswith("attention_mask") or is_node_mask_name(name) or is_padding_mask_name(name)


def is_node_mask_name(name: str) -> bool:
    """Named like a graph neural network's node mask (``node_mask``, ``src_node_mask``): the ``mask`` PyTorch
    Geometric's ``to_dense_batch`` returns beside nodes padded to one count per graph, True or 1 where a node is real,
    as an attention mask's 1. A bare ``mask`` is not taken: an inpainting model's marks the pixels to fill (1 there),
    a masked autoencoder's the patches hidden, neither of them padding."""
    low = name.lower()
    return low == "node_mask" or low.endswith("_node_mask")


def is_padding_mask_name(name: str) -> bool:
    """Named like PyTorch's padding mask (``padding_mask``, ``key_padding_mask``, ``src_key_padding_mask``): True or
    1 marks padding, the inverse of an attention mask."""
    return name.lower().endswith("padding_mask")


def pad_positions(name: str, mask: Any) -> np.ndarray:
    """Where mask input ``name`` (:func:`is_mask_name`) marks padding: its True or non-zero positions for a padding
    mask (:func:`is_padding_mask_name`), its 0 positions for an attention or node mask."""
    mask = np.asarray(mask)
    return mask != 0 if is_padding_mask_name(name) else mask == 0


def is_decoder_name(name: str) -> bool:
    """Named like an encoder-decoder's decoder input (``decoder_input_ids``, ``decoder_attention_mask``), which lies
    on the target's axis, not the source's."""
    return name.lower().startswith("decoder_")


def labelled_padding(inputs: Mapping[str, Any], y: Any) -> tuple[str, int]:
    """The mask input (:func:`is_mask_name`) shaped like the labels per position ``y``, and how many of its padding
    positions (:func:`pad_positions`) carry a label: they count in the loss, accuracy and top-1 agreement like real
    tokens or nodes. ``("", 0)`` where no input is such a mask. Where a decoder input is shaped like the labels (an
    encoder-decoder whose source and target have one length), the labels are the decoder's (Hugging Face's seq2seq
    ``labels``): only a decoder mask speaks of their padding."""
    if not per_position(y):
        return "", 0
    shaped = [name for name, t in inputs.items() if tuple(t.shape) == tuple(y.shape)]
    decoder = any(is_decoder_name(name) for name in shaped)
    for name in shaped:
        if is_mask_name(name) and (is_decoder_name(name) or not decoder):
            t = inputs[name]
            pad = (t != 0) if is_padding_mask_name(name) else (t == 0)
            return name, int((pad & (y != IGNORE_LABEL)).sum())
    return "", 0


def axis_name(axes: Axes | None, name: str, axis: int) -> str | None:
    """The name ``axes`` (input or output -> {axis: name}) gives axis ``axis`` of ``name``; None where it gives
    none."""
    for index, label in ((axes or {}).get(name) or {}).items():
        if int(index) == axis:
            return label
    return None


# Axis names exporters make up, one per input and axis, whatever the sizes: torch.onnx.export with list-form
# dynamic_axes (``input_ids_dynamic_axes_1``), tf2onnx (``unk__12``), the dynamo exporter (``s0``, ``u1``, and
# expressions such as ``s0 + 1``), shape inference (``dim_3``, ``MatMul_output_dim_1``). Two inputs of one length
# get two such names: they tell nothing of which axes are one.
MADE_NAME = re.compile(r"(?:.*_dynamic_axes_\d+|unk__\d+|[su]\d+|(?:.*_)?dim_\w*|.*[-+*/%()<>=, ].*)")


def exporter_made(label: str) -> bool:
    """Whether an axis name is one an exporter made up (:data:`MADE_NAME`), not one a person gave."""
    return MADE_NAME.fullmatch(label.strip()) is not None


def given_axis_name(axes: Axes | None, name: str, axis: int) -> str | None:
    """:func:`axis_name`, but None for a name an exporter made up (:func:`exporter_made`): only a name a person
    gave says that two axes are one, or not."""
    label = axis_name(axes, name, axis)
    return None if label is None or exporter_made(str(label)) else label


def _masks(feed: Mapping[str, Any], shape: tuple[int, ...]) -> list[str]:
    """The attention-mask inputs of ``feed`` (:func:`is_mask_name`, ``[batch, seq]`` integers) shaped ``shape``."""
    found = []
    for name, value in feed.items():
        mask = np.asarray(value)
        if is_mask_name(name) and mask.ndim == 2 and mask.dtype.kind in "iub" and mask.size and mask.shape == shape:
            found.append(name)
    return found


def _rivals(mask: str, shape: tuple[int, ...], feed: Mapping[str, Any], axes: Axes | None) -> list[str]:
    """Inputs as long as an output (``shape``: its batch and position sizes) that may lie on another axis than
    ``mask``: another mask that marks other positions, an input whose given axis name differs from the mask's
    (:func:`given_axis_name`), or, where either has none, a decoder input beside an encoder mask (or the reverse).
    Without names, an input shaped like the mask at every point (the input ids beside their mask) is no rival."""
    ref, own = np.asarray(feed[mask]), given_axis_name(axes, mask, 1)
    rivals = []
    for name, value in feed.items():
        value = np.asarray(value)
        if name == mask or value.ndim < 2 or tuple(value.shape[:2]) != shape:
            continue
        other = given_axis_name(axes, name, 1)
        if (
            is_mask_name(name)
            and value.shape == ref.shape
            and (pad_positions(name, value) != pad_positions(mask, ref)).any()
        ):
            rivals.append(name)
        elif own is not None and other is not None:
            if other != own:
                rivals.append(name)
        elif is_decoder_name(name) != is_decoder_name(mask):
            rivals.append(name)
    return rivals


def mask_of(
    output: str, shape: tuple[int, ...], feed: Mapping[str, Any], axes: Axes | None = None, out_axes: Axes | None = None
) -> tuple[str | None, list[str]]:
    """The attention-mask input whose padding is that of ``output`` (shaped ``shape``), and the inputs tied with it.

    By axis name where both are given (``axes``: the inputs' dynamic axes; ``out_axes``: the outputs'; names an
    exporter made up count as none, :func:`given_axis_name`): the mask
    whose axis 1 has the name of the output's axis 1, or none (a decoder's logits beside the encoder's mask alone).
    Else by shape: the mask shaped like the output's first two axes, unless inputs on another axis are as long
    (an encoder-decoder whose source and target have one length): then no mask, since a guess would leave real
    positions uncompared, and the tied inputs are returned for a warning."""
    shape = tuple(shape[:2])
    masks = _masks(feed, shape) if len(shape) == 2 else []
    if not masks:
        return None, []
    want = given_axis_name(out_axes, output, 1)
    if want not in {label for dims in (axes or {}).values() for label in dims.values()}:
        want = None  # a name of the output's own: no input axis has it
    named = [name for name in masks if given_axis_name(axes, name, 1) is not None]
    if want is not None and named:
        return next((name for name in named if given_axis_name(axes, name, 1) == want), None), []
    rivals = _rivals(masks[0], shape, feed, axes)
    return (None, [masks[0], *rivals]) if rivals else (masks[0], [])


def padding_ties(
    feed: Mapping[str, Any], outputs: Mapping[str, np.ndarray], axes: Axes | None = None, out_axes: Axes | None = None
) -> dict[str, list[str]]:
    """Output -> the inputs tied for its padding (:func:`mask_of`), for the outputs whose padding no name decides:
    :func:`without_padding` compares every position of those."""
    ties = {}
    for name, value in outputs.items():
        _, tied = mask_of(name, np.shape(value), feed, axes, out_axes)
        if tied:
            ties[name] = tied
    return ties


def without_padding(
    feed: Mapping[str, Any],
    outputs: dict[str, np.ndarray],
    axes: Axes | None = None,
    out_axes: Axes | None = None,
) -> dict[str, np.ndarray]:
    """``outputs`` with the positions a mask of ``feed`` marks as padding (:func:`pad_positions`) set to 0, in each
    output laid out ``[batch, seq, ...]`` on that mask's axis (:func:`mask_of`: by the axis names ``axes`` of the inputs
    and ``out_axes`` of the outputs where known): no one reads an answer there, and runtimes differ there (a causal LM
    padded on the left has positions that attend to nothing, whose values PyTorch and ONNX Runtime compute differently).
    Comparisons of an engine with the model read the positions the mask keeps. A float output whose last axis is the
    mask's (a question-answering head's span logits ``[batch, seq]``) gets -inf there instead: its argmax is over the
    positions, and a 0 at padding would win wherever every real logit is below 0, as one in both the reference and a
    wrong engine (a -inf in both is set aside by every comparison: :func:`kiln.core.compare.set_aside`)."""
    out, changed = {}, False
    for name, value in outputs.items():
        mask, _ = mask_of(name, np.shape(value), feed, axes, out_axes)
        pad = None if mask is None else pad_positions(mask, feed[mask])
        if pad is not None and pad.any():
            over_positions = value.ndim == pad.ndim and value.dtype.kind == "f"
            fill = np.array(-np.inf if over_positions else 0, value.dtype)
            value = np.where(pad.reshape(pad.shape + (1,) * (value.ndim - 2)), fill, value)
            changed = True
        out[name] = value
    return out if changed else outputs


def left_padded(feed: Mapping[str, Any], axes: Axes) -> set[str]:
    """The dynamic axes (by name) on which a mask of ``feed`` (an attention or padding mask, :func:`is_mask_name`,
    integers or booleans) shows left padding: every row's last position is a real token and some row's first is padding,
    as batches padded for generation are. Such rows hold their real tokens at the end of the axis."""
    found = set()
    for name, dims in axes.items():
        mask = np.asarray(feed[name]) if name in feed and is_mask_name(name) else None
        if mask is None or mask.dtype.kind not in "iub" or not mask.size:
            continue
        pad = pad_positions(name, mask)
        for axis, label in dims.items():
            first, last = np.take(pad, 0, axis=int(axis)), np.take(pad, -1, axis=int(axis))
            if not last.any() and first.any():
                found.add(label)
    return found


def padding_value(feed: Mapping[str, Any], name: str) -> int | None:
    """The value integer input ``name`` of ``feed`` holds where an attention mask shaped like it (of the same side,
    encoder or decoder: :func:`is_decoder_name`) marks padding, the most common one: the data's pad token (0, or a
    Llama's eos id), a mask's own 0. None where no such mask marks any position, or the input holds floats."""
    value = np.asarray(feed[name])
    if value.dtype.kind not in "iub":
        return None
    for other, mask in feed.items():
        mask = np.asarray(mask)
        if is_mask_name(other) and is_decoder_name(other) == is_decoder_name(name) and mask.shape == value.shape:
            pad = pad_positions(other, mask)
            if mask.dtype.kind in "iub" and pad.any():
                found, counts = np.unique(value[pad], return_counts=True)
                return found[counts.argmax()].item()
    return None


def labelled(y: Any) -> Any:
    """How many labels ``y`` holds (positions marked ``IGNORE_LABEL`` do not count); a tensor for a tensor, on its
    device, so counting does not wait for the GPU."""
    return (y != IGNORE_LABEL).sum()


def dense_cross_entropy(logits: Any, y: Any) -> Any:
    """Mean cross-entropy over the labelled positions of ``y``; 0 (not NaN) where none is labelled."""
    import torch

    axis = class_axis(logits.ndim)
    flat = torch.movedim(logits, axis, -1).reshape(-1, logits.shape[axis])
    total = torch.nn.functional.cross_entropy(flat, y.reshape(-1), ignore_index=IGNORE_LABEL, reduction="sum")
    return total / labelled(y).clamp(min=1)


def are_indices(logits: Any, y: Any) -> bool:
    """Whether ``y`` can be class indices of ``logits``: integers of the logits' shape without the class axis (a
    multi-hot ``[N, K]`` or a ``[N, 1]`` column beside ``[N, C]`` logits is not, and would broadcast)."""
    if floating(y) or logits.ndim < 2:
        return False
    shape = list(logits.shape)
    del shape[class_axis(logits.ndim)]
    return list(y.shape) == shape


def hits(logits: Any, y: Any) -> Any:
    """Labelled rows or positions whose argmax over the class axis is their label (a tensor, like ``labelled``); one
    whose logits hold a NaN is no hit, whatever the argmax makes of it (class 0)."""
    axis = class_axis(logits.ndim)
    best = logits.max(axis)  # NaN where the row holds one (numpy's and torch's max propagate it)
    best = getattr(best, "values", best)  # torch's max over an axis gives (values, indices)
    return ((logits.argmax(axis) == y) & (y != IGNORE_LABEL) & (best == best)).sum()  # NaN is not equal to itself


def accuracy(logits: np.ndarray, labels: np.ndarray) -> float | None:
    """Fraction of labelled rows or positions whose argmax over the class axis is their label (None: none is, or the
    labels are no class indices of these logits)."""
    if not are_indices(logits, labels):
        return None
    count = int(labelled(labels))
    return float(hits(logits, labels)) / count if count else None
