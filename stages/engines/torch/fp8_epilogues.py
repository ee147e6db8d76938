"""An FP8 layer, its GELU and the next FP8 layer's input cast as one GEMM (``build.torch.gemm_epilogues``, FP8 GPU
engines with static scales).

In the exported program of an FP8 engine (:mod:`.lowbit`, static scaling) a transformer's FFN reads::

    y = _scaled_mm(xq, w.t(), sx, sw, bias, None, float16, True)   # FP8 GEMM, bias in cuBLASLt's epilogue
    q = to(clamp(to(gelu(y), float32) * next_inv_scale, -448, 448), float8_e4m3fn)   # a kernel of its own
    z = _scaled_mm(q, w2.t(), next_scale, ...)

(with reshapes around the GELU). This pass replaces ``y`` to ``q`` by ``kiln::fp8_linear_bias_gelu``, one cuBLASLt
call with the bias, the GELU and the FP8 output in its epilogue (:mod:`.cublaslt`): the activation is written once,
in FP8, instead of written in FP16, read, and written again. Written here because neither Inductor nor
``torch._scaled_mm`` offers that epilogue. The GELU becomes cuBLASLt's tanh form (an exact GELU, BERT's, moves by
at most 4.7e-4 before a cast whose steps are 1/16 of the value); validation's gates judge the engine. Where cuBLASLt
has no algorithm for a layer (another GPU, another library version) the layer is left as it was, said once in the
log; the op's own fallback (``_scaled_mm``, a GELU and a cast) covers a shape refused at run time only.
"""

from __future__ import annotations

import logging
from functools import cache
from typing import TYPE_CHECKING, Any

from kiln.stages.engines.torch import cublaslt
from kiln.stages.engines.torch.fx_graph import replace_node

if TYPE_CHECKING:  # torch is imported where it is used: the engines' modules load without it
    import torch
    from torch import fx

log = logging.getLogger("kiln.build")
VIEWS = ("aten.reshape.default", "aten.view.default", "aten._unsafe_view.default")
E4M3_MAX = 448.0


@cache
def register_op() -> None:
    """Define ``kiln::fp8_linear_bias_gelu`` and ``kiln::fp8_linear_bias`` (once per process; a loaded engine's
    process defines them again when it rewrites its program). ``measure``: cuBLASLt's algorithm chosen by timing
    its first candidates on the layer's first call (``build.torch.gemm_algorithms: measured``)."""
    import torch

    schema = (
        "(Tensor x, Tensor weight, Tensor scale_x, Tensor scale_w, Tensor bias, Tensor out_inv_scale, "
        "bool measure=False) -> Tensor"
    )

    @torch.library.custom_op("kiln::fp8_linear_bias_gelu", mutates_args=(), schema=schema)
    def fp8_linear_bias_gelu(
        x: torch.Tensor,
        weight: torch.Tensor,
        scale_x: torch.Tensor,
        scale_w: torch.Tensor,
        bias: torch.Tensor,
        out_inv_scale: torch.Tensor,
        measure: bool = False,
    ) -> torch.Tensor:
        """``x`` [m, k] and ``weight`` [n, k] in E4M3 to the next layer's E4M3 input [m, n]."""
        if x.is_cuda:
            try:
                return cublaslt.linear_bias_gelu_fp8(x, weight, scale_x, scale_w, bias, out_inv_scale, measure)
            except cublaslt.Unavailable as exc:
                _said_once(str(exc))
        return reference(x, weight, scale_x, scale_w, bias, out_inv_scale)

    @fp8_linear_bias_gelu.register_fake
    def _shape(x: torch.Tensor, weight: torch.Tensor, *_: Any) -> torch.Tensor:
        return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.float8_e4m3fn)

    linear_schema = "(Tensor x, Tensor weight, Tensor scale_x, Tensor scale_w, Tensor bias) -> Tensor"

    @torch.library.custom_op("kiln::fp8_linear_bias", mutates_args=(), schema=linear_schema)
    def fp8_linear_bias(
        x: torch.Tensor, weight: torch.Tensor, scale_x: torch.Tensor, scale_w: torch.Tensor, bias: torch.Tensor
    ) -> torch.Tensor:
        """The FP8 layer as ``torch._scaled_mm`` computes it (output in the bias's dtype), with the algorithm
        chosen by measurement on the GPU."""
        if x.is_cuda:
            try:
                return cublaslt.linear_bias_fp8(x, weight, scale_x, scale_w, bias)
            except cublaslt.Unavailable as exc:
                _said_once(str(exc), "torch._scaled_mm's call")
        return _scaled_mm(x, weight, scale_x, scale_w, bias)

    @fp8_linear_bias.register_fake
    def _linear_shape(
        x: torch.Tensor, weight: torch.Tensor, scale_x: torch.Tensor, scale_w: torch.Tensor, bias: torch.Tensor
    ) -> torch.Tensor:
        return x.new_empty((x.shape[0], weight.shape[0]), dtype=bias.dtype)


def _scaled_mm(x: Any, weight: Any, scale_x: Any, scale_w: Any, bias: Any) -> Any:
    """The FP8 engine's own call of a layer: E4M3 inputs, per-tensor scales, the bias in the epilogue."""
    import torch

    return torch._scaled_mm(
        x, weight.t(), scale_a=scale_x, scale_b=scale_w, bias=bias, out_dtype=bias.dtype, use_fast_accum=True
    )


def reference(x: Any, weight: Any, scale_x: Any, scale_w: Any, bias: Any, out_inv_scale: Any) -> Any:
    """What the op computes, in PyTorch's own calls: the FP8 GEMM with its bias, the tanh GELU, the cast."""
    import torch

    g = torch.nn.functional.gelu(_scaled_mm(x, weight, scale_x, scale_w, bias).float(), approximate="tanh")
    return (g * out_inv_scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def accuracy_hint(builder_settings: dict[str, object]) -> str | None:
    """For an FP8 engine that missed an accuracy gate: the sentence naming its fused layers' tanh GELU, if any."""
    layers = builder_settings.get("fp8_epilogue_layers") or {}
    fused = layers.get("linear_bias_gelu_fp8", 0) if isinstance(layers, dict) else 0
    if not fused:
        return None
    return (
        f"{fused} FP8 layer(s) run their GELU in cuBLASLt's epilogue, which computes the tanh approximation "
        "(build.torch.gemm_epilogues: off keeps the model's own GELU)"
    )


@cache
def _said_once(reason: str, kept: str = "its GEMM, GELU and cast") -> None:
    log.warning("FP8 GEMM through cuBLASLt: %s; the layer keeps %s", reason, kept)


def fuse_fp8_gelu(gm: fx.GraphModule, measure: bool = False) -> int:
    """Rewrite ``gm`` in place; returns how many FP8 layers took their GELU and the next layer's input cast.
    ``measure``: the op chooses cuBLASLt's algorithm by measurement."""
    register_op()
    fused = 0
    for node in list(gm.graph.nodes):
        match = _match(node)
        if match is None:
            continue
        xq, weight, scale_x, scale_w, bias, inv, cast, dead = match
        if not _cublaslt_takes(weight, bias, gelu=True):  # the op's reference would be slower than Inductor's kernels
            continue
        with gm.graph.inserting_before(cast):
            op = gm.graph.call_function(_op("fp8_linear_bias_gelu"), (xq, weight, scale_x, scale_w, bias, inv, measure))
        cast.replace_all_uses_with(op)
        _erase(gm.graph, [cast, *dead])
        fused += 1
    _recompile_if(gm, fused)
    log.info("FP8 GEMM epilogues: %d layer(s) with their GELU and the next layer's input cast", fused)
    return fused


def measure_fp8_gemms(gm: fx.GraphModule) -> int:
    """Rewrite ``gm``'s remaining static FP8 layers (``_scaled_mm`` with per-tensor scales and a bias) into
    ``kiln::fp8_linear_bias``, the same GEMM through Kiln's binding with cuBLASLt's algorithm chosen by measurement
    (``build.torch.gemm_algorithms: measured``); returns how many. Run after :func:`fuse_fp8_gelu`."""
    register_op()
    taken = 0
    for node in list(gm.graph.nodes):
        gemm = _static_gemm(node)
        if gemm is None or not _cublaslt_takes(gemm[1], gemm[4], gelu=False):
            continue
        transposed = node.args[1]
        replace_node(gm.graph, node, _op("fp8_linear_bias"), gemm)
        if not transposed.users:
            gm.graph.erase_node(transposed)
        taken += 1
    if _recompile_if(gm, taken):
        log.info("build.torch.gemm_algorithms: measured: %d FP8 layer(s) through cuBLASLt", taken)
    return taken


def _recompile_if(gm: fx.GraphModule, changed: int) -> int:
    """Check and regenerate ``gm``'s code where a rewrite ``changed`` nodes; returns ``changed``."""
    if changed:
        gm.graph.lint()
        gm.recompile()
    return changed


def _cublaslt_takes(weight: fx.Node, bias: fx.Node, gelu: bool) -> bool:
    """Whether cuBLASLt has the call for this layer on its GPU (the GELU and FP8 output epilogue, or the bias alone;
    asked once per shape; a program on the CPU, where the op is its reference, is rewritten as it is)."""
    w, b = weight.meta.get("val"), bias.meta.get("val")
    if w is None or b is None or w.device.type != "cuda":
        return w is not None and b is not None
    try:
        if gelu:
            cublaslt.gelu_fp8_gemm(128, *w.shape, b.dtype, w.device)
        else:
            out_type = cublaslt.cuda_type(b.dtype)
            cublaslt.gemm(128, *w.shape, out_type, cublaslt.EPILOGUE_BIAS, out_type, w.device)
    except cublaslt.Unavailable as exc:
        _said_once(str(exc), "its GEMM, GELU and cast" if gelu else "torch._scaled_mm's call")
        return False
    return True


def _op(name: str) -> Any:
    import torch

    return getattr(torch.ops.kiln, name).default


def _static_gemm(node: fx.Node) -> tuple[Any, ...] | None:
    """``node`` an FP8 ``_scaled_mm`` of a layer with static scales as the engine writes it (per-tensor float32
    scales, a bias of the output's dtype, fast accumulation, the weight transposed): (x, weight, scale_x, scale_w,
    bias); else None."""
    import torch

    if node.op != "call_function" or node.target is not torch.ops.aten._scaled_mm.default:
        return None
    args = list(node.args) + [None] * (8 - len(node.args))
    xq, wt, scale_x, scale_w, bias, scale_result, out_dtype, fast_accum = args[:8]
    if bias is None or scale_result is not None or node.kwargs or fast_accum is not True:
        return None
    if out_dtype not in (torch.float16, torch.bfloat16) or _dtype(bias) != out_dtype:
        return None
    if not all(_one_value(s) for s in (scale_x, scale_w)):
        return None
    if not (isinstance(wt, torch.fx.Node) and wt.target is torch.ops.aten.t.default):
        return None
    return xq, wt.args[0], scale_x, scale_w, bias


def _match(node: fx.Node) -> tuple[Any, ...] | None:
    """``node`` an FP8 layer with static scales (:func:`_static_gemm`) whose only way on is a GELU and the next
    layer's static cast: its inputs, the cast node (whose users take the op's output) and the nodes that go with
    it; else None."""
    import torch

    gemm = _static_gemm(node)
    if gemm is None:
        return None
    chain = [node]
    gelu = _through_views(node, chain)
    if gelu is None or gelu.target is not torch.ops.aten.gelu.default:
        return None
    chain.append(gelu)
    to32 = _through_views(gelu, chain)
    if to32 is None or not _is_cast(to32, torch.float32):
        return None
    chain.append(to32)
    mul = _only_user(to32)
    if mul is None or mul.target is not torch.ops.aten.mul.Tensor or mul.args[0] is not to32:
        return None
    chain.append(mul)
    clamp = _only_user(mul)
    if clamp is None or clamp.target is not torch.ops.aten.clamp.default:
        return None
    if tuple(clamp.args[1:3]) != (-E4M3_MAX, E4M3_MAX):
        return None
    chain.append(clamp)
    cast = _only_user(clamp)
    if cast is None or not _is_cast(cast, torch.float8_e4m3fn) or not _one_value(mul.args[1]):
        return None
    if _shape(cast) is None or len(_shape(cast)) != 2:  # the op answers [rows, n], as the cast must have
        return None
    return *gemm, mul.args[1], cast, chain[::-1]


def _shape(node: Any) -> tuple[int, ...] | None:
    """The shape torch.export recorded for ``node`` (its ``meta["val"]``); None where there is none."""
    val = getattr(node, "meta", {}).get("val")
    return tuple(val.shape) if val is not None and hasattr(val, "shape") else None


def _dtype(node: Any) -> Any:
    val = getattr(node, "meta", {}).get("val")
    return getattr(val, "dtype", None)


def _one_value(node: Any) -> bool:
    """``node`` is a tensor of one float32 value (a per-tensor scale: what cuBLASLt reads from a scale pointer)."""
    import torch

    shape = _shape(node)
    return shape is not None and len(shape) <= 1 and all(d == 1 for d in shape) and _dtype(node) == torch.float32


def _users(node: fx.Node) -> list[fx.Node]:
    """``node``'s users but the metadata assertions torch.export leaves beside casts."""
    import torch

    return [u for u in node.users if u.target is not torch.ops.aten._assert_tensor_metadata.default]


def _only_user(node: fx.Node) -> fx.Node | None:
    users = _users(node)
    return users[0] if len(users) == 1 else None


def _through_views(node: fx.Node, chain: list[fx.Node]) -> fx.Node | None:
    """The first user of ``node`` past reshapes and views (each its only user, added to ``chain``)."""
    user = _only_user(node)
    while user is not None and str(user.target) in VIEWS:
        chain.append(user)
        user = _only_user(user)
    return user


def _is_cast(node: fx.Node, dtype: torch.dtype) -> bool:
    """``node`` converts its input to ``dtype`` (``aten.to.dtype``, or ``_to_copy`` with only a dtype)."""
    import torch

    if node.op != "call_function":
        return False
    if node.target is torch.ops.aten.to.dtype:
        return len(node.args) > 1 and node.args[1] == dtype
    if node.target is torch.ops.aten._to_copy.default:
        return node.kwargs.get("dtype") == dtype and set(node.kwargs) <= {"dtype"}
    return False


def _erase(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    """Erase ``nodes`` (users first) with the metadata assertions on them, and a transpose left without users."""
    import torch

    for node in nodes:
        for user in list(node.users):
            if user.target is torch.ops.aten._assert_tensor_metadata.default:
                graph.erase_node(user)
        transposed = node.args[1] if node.target is torch.ops.aten._scaled_mm.default else None
        graph.erase_node(node)
        if isinstance(transposed, torch.fx.Node) and not transposed.users:
            graph.erase_node(transposed)
