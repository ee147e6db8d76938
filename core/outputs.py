"""A model's outputs as named tensors, and which of them holds the class logits.

A model may return a tensor, a tuple, a dict or a HuggingFace ``ModelOutput`` (an ordered dict whose unset
fields are ``None``), nested or not. Every stage sees them flattened the same way, so an ONNX output, a PyTorch
output and a validation row share one name: ``logits`` for a bare tensor, ``output_<i>`` for tuple items, the keys
of a dict, the fields of a NamedTuple, and ``parent.child`` paths inside nested ones. A ``None`` among them (an
absent loss: nanoGPT's ``(logits, None)``) is left out, as ``torch.onnx.export`` leaves it out; the others keep
their names. Which output holds the class logits is :mod:`kiln.core.output_names`' (no torch there), re-exported
here.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import nn

from kiln.core.data import call, rebuild, tensors
from kiln.core.errors import ModelError
from kiln.core.output_names import SINGLE_OUTPUT, class_logits, logits_flag, logits_name


def flatten_outputs(out: Any, ref: str = "model", left_out: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Named output tensors in the model's order; anything that is not a tensor is a :class:`ModelError`. Nested
    tuples, lists, dicts and ModelOutputs (CLIP's ``text_model_output``) are flattened too, their tensors named by
    their path (``text_model_output.pooler_output``, ``output_1.0``). A ``None`` inside them is left out (an ONNX
    graph has no None outputs) and the other items keep their names, so ``(logits, None)`` gives ``output_0``;
    ``left_out``, where given, receives the names of those left out."""
    if isinstance(out, torch.Tensor):
        return {SINGLE_OUTPUT: out}
    if not isinstance(out, (Mapping, tuple, list)):
        raise ModelError(
            f"{ref} returns {type(out).__name__}, not a tensor, tuple, dict or ModelOutput",
            hint="return the output tensors from forward()",
        )
    items = dict(_leaves(out, "", ref, left_out if left_out is not None else []))
    if not items:
        raise ModelError(f"{ref} returns no tensor", hint="return the output tensors from forward()")
    return items


def _leaves(value: Any, path: str, ref: str, left_out: list[str]) -> list[tuple[str, torch.Tensor]]:
    """``(path, tensor)`` of every tensor inside a container output; ``path`` is the container's own name ("" at
    the top, where tuple items are ``output_<i>``). The paths of ``None`` items go to ``left_out``."""
    if isinstance(value, Mapping):  # dicts and ModelOutput (whose unset optional fields are not among its items)
        children = [(str(k), v) for k, v in value.items()]
    elif isinstance(value, tuple) and hasattr(value, "_fields"):  # a NamedTuple: named by its fields, as a dict
        children = [(str(k), v) for k, v in zip(value._fields, value)]
    else:
        children = [(f"output_{i}" if not path else str(i), v) for i, v in enumerate(value)]
    leaves: list[tuple[str, torch.Tensor]] = []
    for key, child in children:
        name = f"{path}.{key}" if path else key
        if child is None:
            left_out.append(name)
        elif isinstance(child, torch.Tensor):
            leaves.append((name, child))
        elif isinstance(child, (Mapping, tuple, list)):
            leaves += _leaves(child, name, ref, left_out)
        else:
            kind = type(child).__name__
            hint = (
                "a transformers model returns its key/value cache (past_key_values) when its config has use_cache: "
                "build it with use_cache=False, or return the tensors you serve (e.g. outputs.logits)"
                if kind.endswith("Cache")
                else "return only tensors (in tuples, lists, dicts or ModelOutputs) from forward()"
            )
            raise ModelError(f"{ref} returns output '{name}' as {kind}, not a tensor", hint=hint)
    return leaves


class FlatModel(nn.Module):
    """``model`` taking its inputs as positional tensors (in ``like``'s order) and returning a tuple of output
    tensors (in :func:`flatten_outputs`'s order): the one form ``torch.onnx.export`` and the comparisons need."""

    def __init__(self, model: nn.Module, like: Any) -> None:
        super().__init__()
        # The structure only (the example's rows are not kept); the wrapper's mode is the model's, since an
        # exporter restores the wrapper's mode (and so its children's) when it is done.
        self.model, self.like = model, rebuild(like, [None] * len(tensors(like)))
        self.train(model.training)

    def forward(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(flatten_outputs(call(self.model, rebuild(self.like, list(xs)))).values())


def named_outputs(model: nn.Module, x: Any, left_out: list[str] | None = None) -> dict[str, torch.Tensor]:
    """The model's outputs on ``x`` by name, computed as a graph computes them (:func:`as_traced`): the reference
    every exported or compiled engine is held to. ``left_out``: as for :func:`flatten_outputs`."""
    with as_traced():
        return flatten_outputs(call(model, x), left_out=left_out)


def host_arrays(outputs: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """Outputs as NumPy arrays to compare against: floating tensors as float32, integer and bool ones in their own
    dtype, so a token id or a mask is compared value for value (and an int64 above 2**24 keeps every digit)."""
    return {k: (v.float() if v.is_floating_point() else v).cpu().numpy() for k, v in outputs.items()}


@contextmanager
def as_traced() -> Iterator[None]:
    """torch's fused attention fast path off inside the block. In eval mode it runs ``nn.TransformerEncoder`` with
    a padding mask on nested tensors and returns 0 at the padded positions, which exporters and compilers (that
    trace the plain path) compute like any other: a reference taken on the fast path differs from every engine
    there, by more than any tolerance. The latency baseline keeps it."""
    enabled = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(enabled)


__all__ = ["SINGLE_OUTPUT", "FlatModel", "class_logits", "logits_flag", "logits_name"]
