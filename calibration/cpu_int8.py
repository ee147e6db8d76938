"""Whether this machine's CPU INT8 kernels can saturate, which decides ``calibration.reduce_range: auto``.

ONNX Runtime's x86 integer GEMMs multiply uint8 activations by int8 weights. Without VNNI (AVX2 and the first
AVX-512 CPUs, e.g. Skylake-SP servers) they use VPMADDUBSW, which adds each pair of products into an int16 and
saturates: two products of 255 x 127 overflow it. On such a CPU the INT8 graphs Kiln wrote lost accuracy (CI:
cosine 0.95-0.97 against FP32 on small models that reach 0.99+ elsewhere). ONNX Runtime's quantization guide
(``quantize_static``'s docstring) advises 7-bit weights there (``reduce_range=True``): a pair then stays
within an int16. VNNI's VPDPBUSD accumulates in int32, and ARM's kernels do not saturate either.

Read by hand from ``/proc/cpuinfo`` because only one flag is needed and neither onnxruntime nor torch reports
it; py-cpuinfo would add a dependency (and a subprocess on some systems) for one lookup.
"""
from __future__ import annotations

import platform
from functools import lru_cache
from pathlib import Path

VNNI_FLAGS = ("avx512_vnni", "avx_vnni")
X86 = ("x86_64", "amd64", "i386", "i686")


def saturates(machine: str, cpuinfo: str | None) -> bool:
    """True for an x86 CPU without VNNI, or an x86 CPU whose flags cannot be read (the safe side); ``cpuinfo``:
    the text of /proc/cpuinfo, or None where there is none (not Linux)."""
    if machine.lower() not in X86:
        return False
    if cpuinfo is None:
        return True
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), None)
    return flags is None or not any(f in flags for f in VNNI_FLAGS)


@lru_cache(maxsize=1)
def this_cpu_saturates() -> bool:
    info = Path("/proc/cpuinfo")
    return saturates(platform.machine(), info.read_text(errors="replace") if info.is_file() else None)


def reduce_range(setting: str) -> bool:
    """``calibration.reduce_range`` resolved: ``auto`` is on where this machine's INT8 kernels saturate."""
    return setting == "on" or (setting == "auto" and this_cpu_saturates())
