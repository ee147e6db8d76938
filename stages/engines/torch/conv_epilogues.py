"""Convolutions as one cuDNN call each: BatchNorm folded into the convolution before it, and the bias, a residual add
and the ReLU after it done in cuDNN's fused epilogue (``build.torch.conv_epilogues``).

At batch 1 a ResNet is a few dozen small kernels, and Inductor runs each convolution with its BatchNorm and ReLU (and
residual add) as a second, pointwise kernel; folding BatchNorm alone (as Inductor's freezing does) leaves a bias +
ReLU kernel after each convolution. Neither Inductor nor torch.export has a setting for the fused form, so it is
written here: the fused calls are ATen's own (``torch.cudnn_convolution_relu``, ``torch.cudnn_convolution_add_relu``),
the folding is ``torch.nn.utils.fusion.fuse_conv_bn_weights`` in FP32, and this module finds the pattern in the
exported program and wraps the calls as custom ops (``kiln::conv_bias_relu``, ``kiln::conv_bias_add_relu``) that
Inductor leaves to cuDNN while it compiles everything around them.

The pattern, on torch.export's ATen graph, each intermediate value read only by the next step::

    aten.conv2d(x, w, b?) [-> aten.batch_norm(training=False)] [-> aten.add(_)(., z)] -> aten.relu(_)

Every convolution followed by an inference BatchNorm is folded, also one without a ReLU after it (a ResNet's
downsampling branch) and one with ``padding='same'``, which the fused ops do not take. A residual ``z`` must have the
convolution's shape, and an in-place add must write into the convolution's output. On the CPU the ops compute the
same thing unfused (the rewrite is tested there; ``auto`` never applies it there).
"""

from __future__ import annotations

import logging
from functools import cache
from typing import TYPE_CHECKING, Any

from kiln.stages.engines.torch.fx_graph import attr, drop_unused_attrs, replace_node

if TYPE_CHECKING:  # torch is imported where it is used: the engines' modules load without it
    from torch import fx

log = logging.getLogger("kiln.build")
CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
CONV_DEFAULTS: tuple[Any, ...] = (None, None, None, [1, 1], [0, 0], [1, 1], 1)


def resolve(setting: str, device: str, precision: str, flavour: str) -> bool:
    """Does a ``build.torch.conv_epilogues`` setting apply to this engine? ``auto``: FP16 GPU engines of the compiled
    flavour (measured there; an AOTInductor package cannot hold the custom ops)."""
    if setting != "auto":
        return setting == "on"
    return (device, precision) == ("cuda", "fp16") and flavour != "aotinductor"


def accuracy_hint(builder_settings: dict[str, object]) -> str | None:
    """For an engine that missed an accuracy gate: the sentence that names this rewrite, where it took layers."""
    layers = builder_settings.get("conv_epilogue_layers") or {}
    if not builder_settings.get("conv_epilogues") or not isinstance(layers, dict) or not any(layers.values()):
        return None
    fused = layers.get("conv_bias_relu", 0) + layers.get("conv_bias_add_relu", 0)
    return (
        f"{layers.get('batch_norms_folded', 0)} BatchNorm(s) were folded into convolutions and {fused} "
        "convolution(s) run as cuDNN's fused convolution + bias (+ add) + ReLU (build.torch.conv_epilogues, on by "
        "default for FP16 GPU engines); conv_epilogues: off builds the engine without them"
    )


@cache
def register_ops() -> None:
    """Define ``kiln::conv_bias_relu`` and ``kiln::conv_bias_add_relu`` (once per process; a loaded engine's process
    defines them again when it rewrites its program)."""
    import torch
    from torch.nn import functional

    geometry = "int[] stride, int[] padding, int[] dilation, int groups"

    @torch.library.custom_op(
        "kiln::conv_bias_relu", mutates_args=(), schema=f"(Tensor x, Tensor weight, Tensor bias, {geometry}) -> Tensor"
    )
    def conv_bias_relu(
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor,
        stride: list[int],
        padding: list[int],
        dilation: list[int],
        groups: int,
    ) -> torch.Tensor:
        """``relu(conv2d(x, weight, bias))``: one cuDNN call on the GPU."""
        if x.is_cuda:
            return torch.cudnn_convolution_relu(x, weight, bias, stride, padding, dilation, groups)
        return torch.relu(functional.conv2d(x, weight, bias, stride, padding, dilation, groups))

    @torch.library.custom_op(
        "kiln::conv_bias_add_relu",
        mutates_args=(),
        schema=f"(Tensor x, Tensor weight, Tensor bias, Tensor z, {geometry}) -> Tensor",
    )
    def conv_bias_add_relu(
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor,
        z: torch.Tensor,
        stride: list[int],
        padding: list[int],
        dilation: list[int],
        groups: int,
    ) -> torch.Tensor:
        """``relu(conv2d(x, weight, bias) + z)``: one cuDNN call on the GPU."""
        if x.is_cuda:
            return torch.cudnn_convolution_add_relu(x, weight, z, 1.0, bias, stride, padding, dilation, groups)
        return torch.relu(functional.conv2d(x, weight, bias, stride, padding, dilation, groups) + z)

    # The fake kernels run the unfused ops on fake tensors: the output's shape and memory format (channels_last for
    # a channels_last input, as cuDNN's) are the ones Inductor plans the surrounding kernels for.
    @conv_bias_relu.register_fake
    def _(
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor,
        stride: list[int],
        padding: list[int],
        dilation: list[int],
        groups: int,
    ) -> torch.Tensor:
        return torch.relu(functional.conv2d(x, weight, bias, stride, padding, dilation, groups))

    @conv_bias_add_relu.register_fake
    def _(
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor,
        z: torch.Tensor,
        stride: list[int],
        padding: list[int],
        dilation: list[int],
        groups: int,
    ) -> torch.Tensor:
        return torch.relu(functional.conv2d(x, weight, bias, stride, padding, dilation, groups) + z)


def fuse_conv_epilogues(gm: fx.GraphModule, warn_if_none: bool = True) -> dict[str, int]:
    """Rewrite ``gm`` in place: fold BatchNorms, then fuse each convolution's bias / add / ReLU; returns how many
    layers each step took. ``warn_if_none``: say so when the program has no convolution to fuse (an explicit
    setting; ``auto`` applies to every FP16 GPU engine, most transformers among them)."""
    import torch

    register_ops()
    counts = {"batch_norms_folded": fold_batch_norms(gm), "conv_bias_relu": 0, "conv_bias_add_relu": 0}
    graph = gm.graph
    for conv in [n for n in graph.nodes if _is_conv2d(n)]:
        args = conv_arguments(conv)
        if args["bias"] is None or not _plain_geometry(args):
            continue
        epilogue = _epilogue(conv)
        if epilogue is None:
            continue
        add, z, relu = epilogue
        geometry = (_pair(args["stride"]), _pair(args["padding"]), _pair(args["dilation"]), args["groups"])
        head = (args["input"], args["weight"], args["bias"])
        if add is None:
            replace_node(graph, relu, torch.ops.kiln.conv_bias_relu.default, (*head, *geometry))
        else:
            replace_node(graph, relu, torch.ops.kiln.conv_bias_add_relu.default, (*head, z, *geometry))
            graph.erase_node(add)
        graph.erase_node(conv)
        counts["conv_bias_add_relu" if add is not None else "conv_bias_relu"] += 1
    graph.lint()
    gm.recompile()
    fused = counts["conv_bias_relu"] + counts["conv_bias_add_relu"]
    if not fused and not counts["batch_norms_folded"] and warn_if_none:
        log.warning(
            "build.torch.conv_epilogues: on: the program has no 2-D convolution followed by a BatchNorm or "
            "a ReLU to fold or fuse"
        )
    log.info(
        "convolution epilogues: %d BatchNorms folded, %d convolutions with bias + ReLU, %d with bias + add + "
        "ReLU as one cuDNN call",
        counts["batch_norms_folded"],
        counts["conv_bias_relu"],
        counts["conv_bias_add_relu"],
    )
    return counts


def fold_batch_norms(gm: fx.GraphModule) -> int:
    """Each inference BatchNorm read off a 2-D convolution (and read by nothing else) folded into that convolution's
    weight and bias (``fuse_conv_bn_weights``, in FP32, stored in the weight's dtype and memory format). Returns how
    many were folded; the caller lints and recompiles ``gm`` (:func:`fuse_conv_epilogues` does)."""
    import torch
    from torch.nn.utils.fusion import fuse_conv_bn_weights

    graph, replaced, folded = gm.graph, set[str](), 0
    for bn in [n for n in graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.batch_norm.default]:
        conv, weight, bias, mean, var, training, _, eps = (list(bn.args) + [None] * 8)[:8]
        if training is not False or not _is_conv2d(conv, any_padding=True) or len(conv.users) != 1:
            continue
        args = conv_arguments(conv)
        tensors = {
            "conv_w": args["weight"],
            "conv_b": args["bias"],
            "bn_w": weight,
            "bn_b": bias,
            "mean": mean,
            "var": var,
        }
        if any(v is not None and not _is_attr(v) for v in tensors.values()) or not all(
            _is_attr(tensors[k]) for k in ("conv_w", "mean", "var")
        ):
            continue
        got = {k: None if v is None else attr(gm, v.target) for k, v in tensors.items()}
        w0 = got["conv_w"]
        fp32 = {k: None if v is None else v.detach().float() for k, v in got.items()}
        w, b = fuse_conv_bn_weights(
            fp32["conv_w"], fp32["conv_b"], fp32["mean"], fp32["var"], float(eps), fp32["bn_w"], fp32["bn_b"]
        )
        layout = (
            torch.channels_last
            if w0.is_contiguous(memory_format=torch.channels_last) and w0.dim() == 4
            else torch.contiguous_format
        )
        name = f"_kiln_folded_conv_{folded}"
        gm.register_buffer(f"{name}_weight", w.detach().to(w0.dtype).contiguous(memory_format=layout))
        gm.register_buffer(f"{name}_bias", b.detach().to(w0.dtype))  # buffers: an inference engine trains nothing
        with graph.inserting_before(conv):
            new_w, new_b = graph.get_attr(f"{name}_weight"), graph.get_attr(f"{name}_bias")
        _set_weight_and_bias(conv, new_w, new_b)
        conv.meta = dict(bn.meta)  # the folded convolution's output is the BatchNorm's
        bn.replace_all_uses_with(conv)
        graph.erase_node(bn)
        replaced |= {v.target for v in tensors.values() if v is not None}
        folded += 1
    if folded:
        drop_unused_attrs(gm, replaced)
    return folded


def conv_arguments(node: fx.Node) -> dict[str, Any]:
    """``aten.conv2d``'s arguments by name, its defaults filled in (the graph may leave trailing ones out)."""
    values = dict(zip(CONV_ARGS, CONV_DEFAULTS))
    values.update(zip(CONV_ARGS, node.args))
    values.update(node.kwargs)
    return values


def _is_conv2d(node: Any, any_padding: bool = False) -> bool:
    """An ``aten.conv2d`` call; ``any_padding``: also the overload with a string padding (``'same'``, ``'valid'``:
    EfficientNet's convolutions), which folding can take but the fused ops cannot."""
    import torch

    overloads = (torch.ops.aten.conv2d.default, torch.ops.aten.conv2d.padding)
    return getattr(node, "op", None) == "call_function" and node.target in overloads[: 2 if any_padding else 1]


def _set_weight_and_bias(conv: fx.Node, weight: fx.Node, bias: fx.Node) -> None:
    """The convolution's weight and bias arguments replaced, its other arguments left as the graph has them."""
    args, kwargs = list(conv.args), dict(conv.kwargs)
    args[1] = weight
    if len(args) > 2:
        args[2] = bias
    elif "bias" in kwargs:
        kwargs["bias"] = bias
    else:  # bias and everything after it left at their defaults: bias is the third positional argument
        args.append(bias)
    conv.args, conv.kwargs = tuple(args), kwargs


def _is_attr(node: Any) -> bool:
    return getattr(node, "op", None) == "get_attr"


def _plain_geometry(args: dict[str, Any]) -> bool:
    """Integer (lists of) stride, padding and dilation: what the fused ops take (not ``padding='same'``)."""
    return all(
        isinstance(v, int) or (isinstance(v, (list, tuple)) and all(isinstance(i, int) for i in v))
        for v in (args["stride"], args["padding"], args["dilation"])
    ) and isinstance(args["groups"], int)


def _pair(v: int | list[int] | tuple[int, ...]) -> list[int]:
    return [v, v] if isinstance(v, int) else list(v) * (2 if len(v) == 1 else 1)


def _epilogue(conv: fx.Node) -> tuple[fx.Node | None, fx.Node | None, fx.Node] | None:
    """``(add, z, relu)`` after ``conv`` as the module docstring's pattern has them (``add``/``z`` None without a
    residual), or None where the pattern does not hold."""
    import torch

    aten = torch.ops.aten
    if len(conv.users) != 1:
        return None
    user = next(iter(conv.users))
    add = z = None
    if user.op == "call_function" and user.target in (aten.add.Tensor, aten.add_.Tensor):
        if user.kwargs.get("alpha", 1) != 1 or len(user.args) != 2 or len(user.users) != 1:
            return None
        first, second = user.args
        z = second if first is conv else first
        if user.target is aten.add_.Tensor and first is not conv:  # it writes into z, which others may read
            return None
        if not _same_shape(conv, z):
            return None
        add, user = user, next(iter(user.users))
    if user.op != "call_function" or user.target not in (aten.relu.default, aten.relu_.default):
        return None
    return add, z, user


def _same_shape(conv: fx.Node, z: Any) -> bool:
    """Is ``z`` a tensor of the convolution's shape and dtype (by the export's metadata)? Broadcasting adds are not
    what cuDNN's fused add takes."""
    a, b = conv.meta.get("val"), getattr(z, "meta", {}).get("val")
    return a is not None and b is not None and tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype
