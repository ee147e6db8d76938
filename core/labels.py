"""Integer labels: one per row (classification) or one per position (a label per token for named-entity tagging,
per pixel for segmentation), where ``IGNORE_LABEL`` marks a position that carries none (padding, sub-word pieces).

Per-position labels have the logits' shape without the class axis (:func:`kiln.core.compare.class_axis`: the last
for ``[N, S, C]``, axis 1 for ``[N, C, H, W]``). Losses and accuracies average over the labelled positions only,
as Hugging Face's token-classification models and torch's ``cross_entropy(ignore_index=-100)`` do.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from kiln.core.compare import class_axis

IGNORE_LABEL = -100  # torch's cross_entropy default ignore_index, and what Hugging Face pads token labels with


LABEL_NAMES = {"label", "labels", "target", "targets", "start_positions", "end_positions"}


def is_label_name(name: str) -> bool:
    """Named like the labels a model computes its loss from (``labels``, ``targets``, ``mc_labels``...)."""
    low = name.lower()
    return low in LABEL_NAMES or low.endswith(("_label", "_labels"))


def floating(y: Any) -> bool:
    """A torch tensor's or a numpy array's dtype is a float one."""
    return y.dtype.is_floating_point if hasattr(y.dtype, "is_floating_point") else np.issubdtype(y.dtype, np.floating)


def per_position(y: Any) -> bool:
    """Integer labels with more than one axis: one per position of each row."""
    return y.ndim > 1 and not floating(y)


def copied_input(inputs: Mapping[str, Any], y: Any) -> str | None:
    """The integer input equal to the labels per position ``y`` at every labelled position, or None. Kiln scores the
    logits at position t against the label at t, so labels that repeat an input (Hugging Face's causal-LM ``labels =
    input_ids``, which its model shifts itself) train a model to copy it. Labels of one value throughout say nothing
    of a copy, and are not matched."""
    if not per_position(y):
        return None
    keep = y != IGNORE_LABEL
    given = y[keep]
    if given.numel() == 0 or not bool((given != given[0]).any()):
        return None
    for name, t in inputs.items():
        if tuple(t.shape) == tuple(y.shape) and not floating(t) and bool((t[keep] == given).all()):
            return name
    return None


def is_mask_name(name: str) -> bool:
    """Named like a Hugging Face attention mask (``attention_mask``, ``decoder_attention_mask``): 0 marks padding."""
    return name.lower().endswith("attention_mask")


def labelled_padding(inputs: Mapping[str, Any], y: Any) -> tuple[str, int]:
    """The attention-mask input shaped like the labels per position ``y``, and how many of its 0 (padding)
    positions carry a label: they count in the loss, accuracy and top-1 agreement like real tokens. ``("", 0)``
    where no input is such a mask."""
    if not per_position(y):
        return "", 0
    for name, t in inputs.items():
        if is_mask_name(name) and tuple(t.shape) == tuple(y.shape):
            return name, int(((t == 0) & (y != IGNORE_LABEL)).sum())
    return "", 0


def padding_mask(feed: Mapping[str, Any]) -> np.ndarray | None:
    """The positions an attention-mask input (:func:`is_mask_name`, ``[batch, seq]`` of 0/1) marks as padding
    (True), or None where the inputs have no such mask or it marks none."""
    for name, value in feed.items():
        mask = np.asarray(value)
        if is_mask_name(name) and mask.ndim == 2 and mask.dtype.kind in "iub" and mask.size:
            pad = mask == 0
            return pad if pad.any() else None
    return None


def without_padding(feed: Mapping[str, Any], outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``outputs`` with the positions the attention mask of ``feed`` marks as padding set to 0 in every output laid
    out ``[batch, seq, ...]`` like it: no one reads an answer there, and runtimes differ there (a causal LM padded on
    the left has positions that attend to nothing, whose values PyTorch and ONNX Runtime compute differently).
    Comparisons of an engine with the model read the positions the mask keeps."""
    pad = padding_mask(feed)
    if pad is None:
        return outputs
    out = {}
    for name, value in outputs.items():
        if value.ndim >= 2 and value.shape[:2] == pad.shape:
            value = np.where(pad.reshape(pad.shape + (1,) * (value.ndim - 2)), np.zeros((), value.dtype), value)
        out[name] = value
    return out


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
    """Labelled rows or positions whose argmax over the class axis is their label (a tensor, like ``labelled``)."""
    return ((logits.argmax(class_axis(logits.ndim)) == y) & (y != IGNORE_LABEL)).sum()


def accuracy(logits: np.ndarray, labels: np.ndarray) -> float | None:
    """Fraction of labelled rows or positions whose argmax over the class axis is their label (None: none is, or the
    labels are no class indices of these logits)."""
    if not are_indices(logits, labels):
        return None
    count = int(labelled(labels))
    return float(hits(logits, labels)) / count if count else None
