"""Attention as PyTorch's own fused kernels run it (``build.torch.fused_attention``, GPU engines of the compiled
flavour).

Inductor lowers ``scaled_dot_product_attention`` by asking, on the fake tensors it compiles with, which fused kernel
(cuDNN's, FlashAttention, memory-efficient) takes the call. Where that check refuses them all (a ViT's attention
without a mask, 197 tokens, on an H100 with torch 2.11, though every one of them takes the same call on real
tensors), it falls back to the math form, which upcasts FP16 to FP32: two FP32 batched matmuls and an FP32 softmax
per layer, slower than eager PyTorch. This pass makes each attention call one ``kiln::attention``, a custom op that
Inductor compiles around and that calls ``scaled_dot_product_attention`` on the real tensors at run time, where
PyTorch picks its fused kernel as in eager mode (and inside Kiln's CUDA graphs, which capture it). Written here
because neither torch.export nor Inductor has a setting that keeps the call for the runtime to dispatch.
"""

from __future__ import annotations

import logging
from functools import cache
from typing import TYPE_CHECKING, Any

from kiln.stages.engines.torch.fx_graph import replace_node

if TYPE_CHECKING:  # torch is imported where it is used: the engines' modules load without it
    from torch import fx

log = logging.getLogger("kiln.build")
SDPA = "aten.scaled_dot_product_attention.default"
# The call's arguments after q, k and v, in aten's order, with their defaults
DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


@cache
def register_op() -> None:
    """Define ``kiln::attention`` (once per process; a loaded engine's process defines it again when it rewrites
    its program). Its output is laid out as the fused kernels write theirs, ``[batch, tokens, heads, dim]``
    memory seen as ``[batch, heads, tokens, dim]``, which the fake implementation declares, so the code Inductor
    writes around the call reads it right; a kernel that writes another layout is copied into that one."""
    import torch

    schema = (
        "(Tensor q, Tensor k, Tensor v, Tensor? attn_mask=None, float dropout_p=0.0, bool is_causal=False, "
        "float? scale=None, bool enable_gqa=False) -> Tensor"
    )

    @torch.library.custom_op("kiln::attention", mutates_args=(), schema=schema)
    def attention(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
        )
        return out.transpose(1, 2).contiguous().transpose(1, 2)  # a no-op where the kernel wrote this layout

    @attention.register_fake
    def _shape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
        *_lead, heads, tokens, _dim = q.shape
        lead = torch.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
        return q.new_empty((*lead, tokens, heads, v.shape[-1])).transpose(-3, -2)


def fuse_attention(gm: fx.GraphModule, devices: tuple[str, ...] = ("cuda",), masked: bool = True) -> int:
    """Each 4-D ``scaled_dot_product_attention`` of ``gm`` (its inputs on one of ``devices``, in FP16 or BF16; with
    an attention mask only where ``masked``) as ``kiln::attention``; returns how many. An FP32 attention stays
    Inductor's: FlashAttention and cuDNN do not take FP32, and an engine in FP32 is one asked to compute as PyTorch
    does."""
    import torch

    register_op()
    op = torch.ops.kiln.attention.default
    taken = 0
    for node in [n for n in gm.graph.nodes if n.op == "call_function" and str(n.target) == SDPA]:
        q, k, v = (getattr(a, "meta", {}).get("val") for a in node.args[:3])
        if q is None or q.dim() != 4 or q.device.type not in devices or q.dtype not in (torch.float16, torch.bfloat16):
            continue
        if k is None or v is None or not q.shape[0] == k.shape[0] == v.shape[0]:
            continue  # a batch that broadcasts (learned queries [1, H, Q, D] over a batch of keys): left as it is
        given = dict(zip(DEFAULTS, node.args[3:])) | dict(node.kwargs)
        if masks_nothing(given.get("attn_mask")):
            given["attn_mask"] = None  # the fused kernels without a mask (FlashAttention's) then take the call
        if given.get("attn_mask") is not None and not masked:
            continue
        args = (*node.args[:3], *(given.get(name, default) for name, default in DEFAULTS.items()))
        replace_node(gm.graph, node, op, args)
        taken += 1
    if taken:
        gm.graph.lint()
        gm.recompile()
    return taken


# Ops that only reshape or broadcast what they are given: a mask through them masks what it masked
VIEWS = {"aten.expand.default", "aten.unsqueeze.default", "aten.view.default", "aten.reshape.default"}


def masks_nothing(mask: Any) -> bool:
    """Whether ``mask`` (an FX node, or None) is True everywhere whatever the inputs: ``arange(n) + c >= 0``
    broadcast, the mask ``transformers`` builds for a model without padding (a ViT's) when torch.export traces it,
    which would otherwise keep the call from the fused kernels that take no mask."""
    node = _through_views(mask)
    if getattr(node, "op", None) != "call_function" or str(node.target) != "aten.ge.Scalar":
        return False
    bound = node.args[1]
    return isinstance(bound, int | float) and bound <= 0 and _counts_up_from_zero(node.args[0])


def _through_views(node: Any) -> Any:
    while getattr(node, "op", None) == "call_function" and str(node.target) in VIEWS:
        node = node.args[0]
    return node


def _counts_up_from_zero(node: Any) -> bool:
    """An ``arange`` from 0 (or more), plus a number that is not negative, through views: never below 0."""
    node = _through_views(node)
    target = str(getattr(node, "target", ""))
    if target == "aten.add.Tensor" or target == "aten.add.Scalar":
        tensor, number = node.args[:2]
        alpha = node.kwargs.get("alpha", 1)  # add(x, y, alpha=a) is x + a * y
        up = isinstance(number, int | float) and isinstance(alpha, int | float) and number * alpha >= 0
        return up and _counts_up_from_zero(tensor)
    if target == "aten.arange.default":
        return True
    if target == "aten.arange.start":
        return isinstance(node.args[0], int | float) and node.args[0] >= 0
    return False
