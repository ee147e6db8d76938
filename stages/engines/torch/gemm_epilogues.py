"""Linear layers as cuBLASLt GEMMs with the bias (and GELU) in the GEMM's epilogue (``build.torch.gemm_epilogues``).

Inductor neither puts a linear layer's bias nor a following GELU into the GEMM's epilogue: its own GEMMs add them
as separate kernels, and on its cuBLAS path it first copies the broadcast bias into the output. ATen's ``addmm``
with a 1-D bias runs cuBLASLt with the bias in the epilogue, and ``torch._addmm_activation`` applies GELU there
too. This pass rewrites the exported program's ``aten.linear`` (and a linear whose only user is ``aten.gelu``) into
custom ops that call them; Inductor compiles everything around those opaque ops. Written here because neither
Inductor nor torch.export has a setting for it.

Numerics: ``torch._addmm_activation``'s GELU is the tanh approximation on the GPU and the exact GELU on the CPU.
``bias_gelu`` fuses only the GELUs it computes as the model does; ``bias_any_gelu`` fuses every GELU, so on the GPU
an exact GELU (BERT's) becomes the tanh one, at most 4.7e-4 apart; validation's gates judge the engine.
cuBLASLt's epilogue applies to a contiguous 1-D bias and GEMMs of more than one row; elsewhere the same op is a
GEMM plus the bias and GELU as kernels.

Linears that read the same input (an attention layer's Q, K and V) are merged first (``merge_linears``,
:func:`merge_parallel_linears`): one GEMM over their concatenated weights, its output split back into views.

``auto`` is ``bias_any_gelu`` for FP16 GPU engines (the compiled flavour, which can hold the custom ops) and ``off``
elsewhere: on the CPU each custom op is a Python call. What it buys is measured in ``benchmarks/README.md``.
"""

from __future__ import annotations

import logging
import operator
from functools import cache
from typing import TYPE_CHECKING, Any

from kiln.stages.engines.torch import cublaslt
from kiln.stages.engines.torch.fx_graph import attr, drop_unused_attrs, replace_node

if TYPE_CHECKING:  # torch is imported where it is used: the engines' modules load without it
    import torch
    from torch import fx

log = logging.getLogger("kiln.build")
MODES = ("off", "bias", "bias_gelu", "bias_any_gelu")
EPILOGUE_GELU = {"cuda": "tanh", "cpu": "none"}  # what torch._addmm_activation's GELU computes, per device


def resolve_mode(setting: str, device: str, precision: str, flavour: str) -> str:
    """The mode a ``build.torch.gemm_epilogues`` setting means for an engine on ``device`` at ``precision`` (see the
    module docstring on ``auto``)."""
    if setting != "auto":
        return setting
    return "bias_any_gelu" if (device, precision) == ("cuda", "fp16") and flavour != "aotinductor" else "off"


def accuracy_hint(builder_settings: dict[str, object], device: str) -> str | None:
    """For an engine that missed an accuracy gate: the sentence that names the GELU approximation, if it has one (on
    the GPU, where the epilogue's GELU is the tanh one)."""
    layers = builder_settings.get("gemm_epilogue_layers") or {}
    fused = layers.get("linear_bias_gelu", 0) if isinstance(layers, dict) else 0
    if builder_settings.get("gemm_epilogues") != "bias_any_gelu" or not fused or EPILOGUE_GELU.get(device) != "tanh":
        return None
    return (
        f"{fused} GELU layer(s) run in cuBLASLt's epilogue, which computes the tanh approximation "
        "(build.torch.gemm_epilogues: bias_any_gelu, what auto means for FP16 GPU engines); with bias_gelu only "
        "GELUs the model itself computes that way are fused"
    )


@cache
def register_ops() -> None:
    """Define ``kiln::linear_bias`` and ``kiln::linear_bias_gelu`` (once per process; a loaded engine's process
    defines them again when it rewrites its program). ``measure``: on the GPU, cuBLASLt's algorithm is chosen by
    timing its first candidates on the layer's first call (``build.torch.gemm_algorithms: measured``,
    :func:`kiln.stages.engines.torch.cublaslt.measured`); otherwise ATen's call and the heuristic's choice."""
    import torch

    # Schemas spelled out: with postponed annotations torch cannot read them off the signatures of local functions
    schema = "(Tensor x, Tensor weight, Tensor bias, bool measure=False) -> Tensor"

    @torch.library.custom_op("kiln::linear_bias", mutates_args=(), schema=schema)
    def linear_bias(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, measure: bool = False) -> torch.Tensor:
        """``linear(x, weight, bias)`` as one ``addmm`` with a 1-D bias (cuBLASLt's bias epilogue on the GPU)."""
        flat = x.reshape(-1, x.shape[-1])
        out = _measured(flat, weight, bias, False) if measure and x.is_cuda else None
        if out is None:
            out = torch.addmm(bias, flat, weight.t())
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @torch.library.custom_op("kiln::linear_bias_gelu", mutates_args=(), schema=schema)
    def linear_bias_gelu(
        x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, measure: bool = False
    ) -> torch.Tensor:
        """``gelu(linear(x, weight, bias))`` as one ``_addmm_activation`` (bias + GELU epilogue on the GPU)."""
        flat = x.reshape(-1, x.shape[-1])
        out = _measured(flat, weight, bias, True) if measure and x.is_cuda else None
        if out is None:
            out = torch._addmm_activation(bias, flat, weight.t(), use_gelu=True)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @linear_bias.register_fake
    @linear_bias_gelu.register_fake
    def _shape(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, measure: bool = False) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _measured(x: Any, weight: Any, bias: Any, gelu: bool) -> Any:
    """The GEMM through Kiln's cuBLASLt binding with its algorithm chosen by measurement; None where the binding
    cannot take it (said once), so ATen's call runs. A GEMM of one row keeps ATen's (no epilogue there either)."""
    if x.shape[0] < 2 or bias.dim() != 1:
        return None
    try:
        return cublaslt.linear_bias(x, weight, bias, gelu)
    except cublaslt.Unavailable as exc:
        _said_once(str(exc))
        return None


@cache
def _said_once(reason: str) -> None:
    log.warning("build.torch.gemm_algorithms: measured: %s; the layer keeps ATen's GEMM", reason)


def fuse_linear_epilogues(
    gm: fx.GraphModule, mode: str, warn_if_none: bool = True, merge: bool = False, measure: bool = False
) -> dict[str, int]:
    """Rewrite ``gm`` in place (``mode``: one of :data:`MODES` but ``off``); returns how many layers each op took.

    Only linears with a bias: without one there is nothing for the epilogue, and Inductor's own GEMM is kept. A GELU
    is fused only when it is the linear's only user (and, with ``bias_gelu``, computed as the epilogue computes it).
    ``warn_if_none``: say so when the program has nothing to rewrite (an explicit setting; ``auto`` applies to every
    model, many of which have nothing for it). ``merge``: merge linears that share their input first
    (:func:`merge_parallel_linears`; counted as ``merged_linears``, the layers that went into merged ones).
    ``measure``: the ops choose cuBLASLt's algorithm by measurement (see :func:`register_ops`)."""
    import torch

    if mode not in MODES[1:]:
        raise ValueError(f"gemm epilogue mode {mode!r} is not one of {MODES[1:]}")
    register_ops()
    counts = {"linear_bias": 0, "linear_bias_gelu": 0}
    if merge:
        counts["merged_linears"] = merge_parallel_linears(gm, mode)
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.linear.default:
            continue
        if len(node.args) < 3 or node.args[2] is None:
            continue
        users = list(node.users)
        if len(users) == 1 and _fusable_gelu(users[0], mode):
            gelu = users[0]
            replace_node(graph, gelu, torch.ops.kiln.linear_bias_gelu.default, (*node.args[:3], measure))
            graph.erase_node(node)
            counts["linear_bias_gelu"] += 1
        else:
            replace_node(graph, node, torch.ops.kiln.linear_bias.default, (*node.args[:3], measure))
            counts["linear_bias"] += 1
    graph.lint()
    gm.recompile()
    if not any(counts.values()) and warn_if_none:  # e.g. a model whose layers call torch.addmm (GPT-2's Conv1D)
        log.warning("build.torch.gemm_epilogues: %s: the program has no linear layer with a bias to rewrite", mode)
    log.info(
        "GEMM epilogues (%s): %d linear layers with their bias, %d with bias and GELU%s",
        mode,
        counts["linear_bias"],
        counts["linear_bias_gelu"],
        f" ({counts['merged_linears']} merged into wider GEMMs)" if counts.get("merged_linears") else "",
    )
    return counts


def merge_parallel_linears(gm: fx.GraphModule, mode: str) -> int:
    """Linears with a bias that read the same tensor become one linear over their weights and biases concatenated,
    whose output is split back (``aten.split_with_sizes``: views, no copies). Returns how many linears were merged;
    the caller lints and recompiles ``gm`` (:func:`fuse_linear_epilogues` does, once, after its own rewrite).

    Why: BERT-base's Q, K and V projections at batch 32 are three 4096x768x768 GEMMs, each too small to fill a large
    GPU; one 4096x768x2304 GEMM does the same work in one launch. Only linears whose weight and bias are the
    program's own tensors (``get_attr``) of one dtype and device are merged, and not a linear the epilogue will fuse
    with its GELU (``mode``), which keeps its own op. The merged tensors replace the originals (freed when nothing
    else reads them), so the engine holds each weight once."""
    graph = gm.graph
    groups: dict[tuple[Any, ...], list[fx.Node]] = {}
    for node in graph.nodes:
        key = _merge_key(gm, node, mode)
        if key is not None:
            groups.setdefault(key, []).append(node)
    merged, replaced = 0, set[str]()
    for index, nodes in enumerate(g for g in groups.values() if len(g) > 1):
        replaced |= {a.target for n in nodes for a in n.args[1:3]}
        _merge(gm, nodes, f"_kiln_merged_linear_{index}")
        merged += len(nodes)
    if merged:
        drop_unused_attrs(gm, replaced)
    return merged


def _merge_key(gm: fx.GraphModule, node: fx.Node, mode: str) -> tuple[Any, ...] | None:
    """What a linear must share with another to be merged with it (its input, dtype, device); None: not mergeable."""
    import torch

    if node.op != "call_function" or node.target is not torch.ops.aten.linear.default or len(node.args) < 3:
        return None
    x, weight, bias = node.args[:3]
    if not all(isinstance(a, torch.fx.Node) and a.op == "get_attr" for a in (weight, bias)):
        return None
    users = list(node.users)
    if len(users) == 1 and _fusable_gelu(users[0], mode):
        return None
    w, b = attr(gm, weight.target), attr(gm, bias.target)
    if w.dim() != 2 or b.dim() != 1 or w.dtype != b.dtype or w.device != b.device:
        return None
    return x, w.dtype, w.device


def _merge(gm: fx.GraphModule, nodes: list[fx.Node], name: str) -> None:
    """One linear over ``nodes``' concatenated weights, inserted before the first of them; each of them replaced by
    its slice of the output."""
    import torch

    weights = [attr(gm, n.args[1].target) for n in nodes]
    biases = [attr(gm, n.args[2].target) for n in nodes]
    gm.register_buffer(f"{name}_weight", torch.cat(weights).detach())  # buffers: an inference engine trains nothing
    gm.register_buffer(f"{name}_bias", torch.cat(biases).detach())
    graph = gm.graph
    with graph.inserting_before(nodes[0]):
        weight, bias = graph.get_attr(f"{name}_weight"), graph.get_attr(f"{name}_bias")
        linear = graph.call_function(torch.ops.aten.linear.default, (nodes[0].args[0], weight, bias))
        parts = graph.call_function(
            torch.ops.aten.split_with_sizes.default, (linear, [w.shape[0] for w in weights], -1)
        )
    for i, node in enumerate(nodes):
        with graph.inserting_before(node):
            part = graph.call_function(operator.getitem, (parts, i))
        part.meta = dict(node.meta)
        node.replace_all_uses_with(part)
        graph.erase_node(node)


def _fusable_gelu(node: fx.Node, mode: str) -> bool:
    """Is ``node`` a GELU the epilogue may take in this mode (see the module docstring on numerics)?"""
    import torch

    if node.target is not torch.ops.aten.gelu.default or mode == "bias":
        return False
    if mode == "bias_any_gelu":
        return True
    approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
    val = node.meta.get("val")  # the output's fake tensor: its device says which GELU the epilogue computes
    return val is not None and EPILOGUE_GELU.get(val.device.type) == approximate
