"""Whether this machine's CPU INT8 kernels saturate, and what Kiln does about it.

ONNX Runtime's x86 integer GEMMs multiply uint8 activations by int8 weights. Without VNNI (SSE4.1, AVX2 and the first
AVX-512 CPUs) they use VPMADDUBSW, which adds each pair of products into an int16 and saturates: two products of
255 x 127 overflow it. VNNI's VPDPBUSD accumulates in int32, and ARM's kernels do not saturate.

Two remedies, both ONNX Runtime's own: every session Kiln makes on such a CPU sets ``session.x64quantprecision``
(:data:`PRECISE_INT8`: ORT then multiplies uint8 by uint8, slower and exact), which also covers INT8 graphs
quantized on another machine; and ``calibration.reduce_range`` quantizes weights to 7 bits (a pair of products then
fits an int16) for runtimes that cannot be given the option.

Flags are read from ``/proc/cpuinfo`` (Linux), else from ``torch.cpu.get_capabilities()`` (imported only then, since
torch is slow to import); an x86 CPU whose flags cannot be read counts as saturating.
"""

from __future__ import annotations

import platform
from functools import lru_cache
from pathlib import Path
from typing import Any

# The float layers ONNX Runtime's CPU provider computes in integer kernels from a statically quantized (Q/DQ) graph,
# and those kernels; it has none for ConvTranspose
ORT_CPU_STATIC_INTEGER = {"Conv": "QLinearConv", "MatMul": "QLinearMatMul", "Gemm": "QGemm"}

# ORT's CPU QLinearConv runs fast (NHWC, indirect-GEMM) kernels for 1-D and 2-D convolutions only; a 3-D one falls
# back to a generic im2col path that runs slower than the FP32 Conv it replaces
SLOW_INTEGER_SPATIAL_DIMS = 3

VNNI_FLAGS = ("avx512_vnni", "avx_vnni")
X86 = ("x86_64", "amd64", "x86", "i386", "i686")
PRECISE_INT8 = "session.x64quantprecision"  # ORT session config entry: "1" = U8U8 GEMMs on x64


def saturates(machine: str, flags: list[str] | None) -> bool:
    """True for an x86 CPU without VNNI; ``flags``: its feature flags, None where they cannot be read."""
    if machine.lower() not in X86:
        return False
    return flags is None or not any(f in flags for f in VNNI_FLAGS)


def cpuinfo_flags(text: str) -> list[str] | None:
    """The ``flags`` line of /proc/cpuinfo's text (None without one)."""
    return next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), None)


def _flags() -> list[str] | None:
    info = Path("/proc/cpuinfo")
    if info.is_file():
        return cpuinfo_flags(info.read_text(errors="replace"))
    try:
        import torch

        return [name for name, on in torch.cpu.get_capabilities().items() if on]
    except (ImportError, AttributeError):  # torch < 2.8
        return None


@lru_cache(maxsize=1)
def this_cpu_saturates() -> bool:
    return saturates(platform.machine(), _flags())


def ask_exact_int8(opts: Any) -> Any:
    """``opts`` (onnxruntime SessionOptions) with ORT's exact INT8 kernels where this CPU's fast ones saturate."""
    if this_cpu_saturates():
        opts.add_session_config_entry(PRECISE_INT8, "1")
    return opts


def int8_kernels() -> str:
    """Which ONNX Runtime CPU INT8 kernels Kiln's sessions run here, for reports beside their latencies."""
    return "exact (x86 without VNNI)" if this_cpu_saturates() else "fast"


def resolve_reduce_range(setting: str) -> bool:
    """``calibration.reduce_range`` resolved: ``auto`` is on where this machine's INT8 kernels saturate."""
    return setting == "on" or (setting == "auto" and this_cpu_saturates())


def slow_integer_convs(model: Any) -> list[str]:
    """The convolutions of a quantized ONNX graph (an ``onnx.ModelProto``; onnx is not imported here) that ONNX
    Runtime's CPU provider computes in QLinearConv over :data:`SLOW_INTEGER_SPATIAL_DIMS` spatial dims (a Conv3d),
    where it has no fast kernel: a Conv whose input and weight come from DequantizeLinear (Q/DQ), or a QLinearConv.
    Named by node (else first output), so a user learns before validation that INT8 may run slower than FP32."""
    ranks = {t.name: len(t.dims) for t in model.graph.initializer}
    dq = {n.output[0]: n for n in model.graph.node if n.op_type == "DequantizeLinear"}
    out = []
    for node in model.graph.node:
        if node.op_type == "QLinearConv" and len(node.input) > 3:
            weight = node.input[3]
        elif node.op_type == "Conv" and len(node.input) > 1 and node.input[0] in dq and node.input[1] in dq:
            weight = dq[node.input[1]].input[0]
        else:
            continue
        if _spatial_dims(node, ranks.get(weight)) == SLOW_INTEGER_SPATIAL_DIMS:
            out.append(node.name or node.output[0])
    return out


def _spatial_dims(node: Any, weight_rank: int | None) -> int | None:
    """A convolution's spatial dims: its ``kernel_shape`` attribute's length, else its weight's rank less two."""
    kernel = next((list(a.ints) for a in node.attribute if a.name == "kernel_shape"), None)
    if kernel:
        return len(kernel)
    return None if weight_rank is None else weight_rank - 2
