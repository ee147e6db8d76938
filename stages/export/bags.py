"""``nn.EmbeddingBag`` over padded bags, exported as a lookup and a reduction: both exporters write an
``embedding_bag`` as an ONNX Loop over the bags, which ONNX Runtime runs op by op, one iteration per bag, where the
same bags as ``[N, L]`` ids are one Gather and one ReduceSum. While a model exports, each bag module of ``sum``,
``mean`` or ``max`` mode given 2-D ids (one padded bag per row, no offsets) computes the same values that way:
its ids' rows looked up, the ``padding_idx`` entries left out of the reduction (and of a mean's count), and an
empty bag zeros, as ``nn.EmbeddingBag`` defines them. Flat ids with offsets, and a ``max_norm`` (which renormalizes
the table in place as it looks rows up), keep the module's own forward. The export's parity check holds the graph
to the model's own outputs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import torch
from torch import nn


@contextmanager
def bags_as_lookups(model: nn.Module) -> Iterator[int]:
    """Inside it, the ``nn.EmbeddingBag`` modules of ``model`` (by type, subclasses with a forward of their own
    excepted) take 2-D ids through :func:`bag_lookup`; yields how many there are."""
    bags = [m for m in model.modules() if type(m).forward is nn.EmbeddingBag.forward and m.max_norm is None]
    for bag in bags:
        bag.forward = partial(bag_lookup, bag)  # an instance attribute: the class's forward stays as it is
    try:
        yield len(bags)
    finally:
        for bag in bags:
            del bag.forward


def bag_lookup(
    bag: nn.EmbeddingBag,
    input: torch.Tensor,
    offsets: torch.Tensor | None = None,
    per_sample_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """``bag(input, offsets, per_sample_weights)`` as a lookup and a reduction over each row of 2-D ``input``;
    the module's own forward for anything else."""
    if input.dim() != 2 or offsets is not None:
        return nn.EmbeddingBag.forward(bag, input, offsets, per_sample_weights)
    rows = nn.functional.embedding(input, bag.weight)  # [N, L, D]
    keep = input != bag.padding_idx if bag.padding_idx is not None else torch.ones_like(input, dtype=torch.bool)
    if bag.mode == "max":
        top = rows.masked_fill(~keep[..., None], float("-inf")).amax(1)
        return torch.where(keep.any(1, keepdim=True), top, torch.zeros_like(top))
    weights = keep.to(rows.dtype) if per_sample_weights is None else keep * per_sample_weights.to(rows.dtype)
    total = (rows * weights[..., None]).sum(1)
    if bag.mode == "sum":
        return total
    return total / keep.sum(1, keepdim=True).clamp(min=1).to(rows.dtype)
