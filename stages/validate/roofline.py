"""How far each engine is from the floor: achieved TFLOP/s (FLOPs per sample from the engine's audit, times the
batch, over its p50) beside the device's peak for that precision — measured with a large GEMM in PyTorch and cached
per device where it was measured on a machine that left it its cores, the datasheet figure beside it where known.

The peak is what a large GEMM reaches here, not the datasheet's: an engine at 50 % of it is at half of what this
device does for dense math, which is the floor users compare against. A share above 100 % would say the peak was
measured low (a busy machine), so a row whose engine outruns the measured peak gives no share and says so.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from kiln.core.artifacts import write_text_atomic
from kiln.core.records import EngineValidation
from kiln.core.threads import threads_for_load

log = logging.getLogger("kiln.validate")

# Dense tensor-core TFLOP/s from NVIDIA's datasheets (without sparsity); FP32 is the non-tensor-core figure.
DATASHEET: dict[str, dict[str, float]] = {
    "NVIDIA H200": {"fp16": 989.0, "fp8": 1979.0, "int8": 1979.0, "fp32": 67.0},
    "NVIDIA H100 80GB HBM3": {"fp16": 989.0, "fp8": 1979.0, "int8": 1979.0, "fp32": 67.0},
    "NVIDIA A100-SXM4-80GB": {"fp16": 312.0, "int8": 624.0, "fp32": 19.5},
    "NVIDIA L4": {"fp16": 121.0, "fp8": 242.0, "int8": 242.0, "fp32": 30.3},
}
GEMM = {"cuda": 8192, "cpu": 1024}  # square GEMM size per device: large enough to reach the peak, quick to run
CPU_TIMING_S = 0.1  # per thread count, a CPU peak is the best call of this long a loop (at least MIN_CALLS calls)
MIN_CALLS = 3
HAD_CORES = 0.8  # a CPU peak is cached only where its threads ran this share of the wall time (else other work ran)
METHOD = 2  # cache entries of an earlier method (one timing, cached even when measured on a busy machine) are redone


def sig(x: float) -> float:
    """Four significant figures: a small model or a busy CPU gives thousandths of a TFLOP/s, which decimals round to 0
    (and a peak of 0 reads as not measured)."""
    return float(f"{x:.4g}")


def device_name(device: str) -> str:
    """The GPU's name, or the CPU's with the threads its peak is measured on (:func:`cpu_threads`)."""
    import platform

    import torch

    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"{platform.processor() or platform.machine()} x{cpu_threads()} threads"


def cgroup_cores(path: Path = Path("/sys/fs/cgroup/cpu.max")) -> float | None:
    """The cores a container's CPU limit gives this process (cgroup v2 ``cpu.max``: quota over period); None where
    there is no limit or no such file. Threads past it share that time, so they cannot each run the whole wall."""
    try:
        quota, period = path.read_text().split()[:2]
        return int(quota) / int(period) if quota != "max" else None
    except (OSError, ValueError):
        return None


def cpu_threads() -> int:
    """The threads a CPU peak is measured on: every core this process may use, as ONNX Runtime's CPU engines
    take them (their pools default to the cores), not the fewer PyTorch may run on while a busy machine lowers
    them (:func:`kiln.core.threads.cpu_threads_for_load`): a peak of one thread would put a two-thread engine
    past 100 % of it."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def peak_tflops(device: str, cache_dir: Path | None) -> dict[str, Any]:
    """The device's measured GEMM peak per precision (TFLOP/s), with its datasheet figures; cached per device, but
    only where the measurement had the machine's cores (``busy`` false): one taken while other work ran is low,
    would put engines past 100 % of it, and is measured again by the next run instead."""
    name = device_name(device)
    path = Path(cache_dir) / "peak.json" if cache_dir is not None else None
    cached = _read_cache(path)
    entry = cached.get(name)
    if not entry or entry.get("method") != METHOD:
        measured, busy = _measure(device)
        entry = {"measured": measured, "datasheet": DATASHEET.get(name, {}), "gemm": GEMM[device], "method": METHOD}
        entry["busy"] = busy
        if busy:
            log.info(
                "%s GEMM peak measured while other work ran: not cached, measured again when validation next runs", name
            )
        elif path is not None:
            cached[name] = entry
            path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(path, json.dumps(cached, indent=2))
    return {"device": name, **entry}


def _read_cache(path: Path | None) -> dict[str, Any]:
    """The cached peaks by device name; none where the file is missing or unreadable (it is only a cache)."""
    if path is None or not path.is_file():
        return {}
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return cached if isinstance(cached, dict) else {}


def _measure(device: str) -> tuple[dict[str, float], bool]:
    """The GEMM peak per precision, and whether the machine was busy while it was measured (CPU only: a GPU's
    GEMM does not wait for the CPU's other work)."""
    if device == "cpu":
        fp32, share = _measure_cpu(GEMM["cpu"])
        return {"fp32": fp32}, share < HAD_CORES
    import torch

    n = GEMM[device]
    out = {}
    for label, dtype in {"fp32": torch.float32, "fp16": torch.float16}.items():
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        out[label] = sig(2 * n**3 / _best_seconds(lambda a=a, b=b: a @ b, device) / 1e12)
    out.update(_measure_lowbit(n))
    return out, False


def _measure_cpu(n: int) -> tuple[float, float]:
    """The best FP32 GEMM rate (TFLOP/s) on every core and, where the load average says cores are taken, on the
    cores it leaves idle (many threads on a busy machine wait for time slices and run slower than fewer); with the
    share of the wall time the every-core run's threads got (its CPU time over threads x wall time): under
    :data:`HAD_CORES`, other work took their cores and the figure is below this machine's peak."""
    import torch

    cores = cpu_threads()
    counts = sorted({cores, threads_for_load(cores, os.getloadavg()[0], cores)}, reverse=True)
    a, b = torch.randn(n, n), torch.randn(n, n)
    before = torch.get_num_threads()
    best, shares = 0.0, []
    try:
        for threads in counts:
            torch.set_num_threads(threads)
            cpu0, wall0 = time.process_time(), time.perf_counter()
            seconds = _best_seconds(lambda: a @ b, "cpu")
            room = min(threads, cgroup_cores() or threads)  # a container's limit caps the time its threads get
            shares.append((time.process_time() - cpu0) / ((time.perf_counter() - wall0) * room))
            best = max(best, 2 * n**3 / seconds / 1e12)
    finally:
        torch.set_num_threads(before)
    return sig(best), shares[0]


def _measure_lowbit(n: int) -> dict[str, float]:
    """FP8 and INT8 GEMM peaks with the kernels the torch engine's low-precision layers call, where this GPU has
    them (:mod:`kiln.stages.engines.torch.lowbit`)."""
    import torch

    capability = torch.cuda.get_device_capability()  # as kiln.stages.engines.torch.lowbit.MIN_CAPABILITY
    has = {"fp8": capability >= (8, 9), "int8": capability >= (8, 0)}
    a = torch.randn(n, n, device="cuda")
    one = torch.ones((), device="cuda")
    f8, i8 = a.to(torch.float8_e4m3fn), a.clamp(-127, 127).to(torch.int8)
    calls = {
        "fp8": lambda: torch._scaled_mm(f8, f8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
        "int8": lambda: torch._int_mm(i8, i8.t()),
    }
    return {k: sig(2 * n**3 / _best_seconds(fn, "cuda") / 1e12) for k, fn in calls.items() if has[k]}


def _best_seconds(fn: Any, device: str, calls: int = 10) -> float:
    """The fastest of ``calls`` calls after a warm-up one; on a CPU, of as many as :data:`CPU_TIMING_S` holds (at
    least :data:`MIN_CALLS`), so that a slow machine stays within its time and a fast one gets more chances."""
    import torch

    fn()
    best, done, start = float("inf"), 0, time.perf_counter()
    while (done < calls) if device == "cuda" else (done < MIN_CALLS or time.perf_counter() - start < CPU_TIMING_S):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        best, done = min(best, time.perf_counter() - t0), done + 1
    return best


def roofline(
    entry: EngineValidation, flops_per_sample: int, peak: dict[str, Any], covers: float = 1.0
) -> dict[str, dict[str, Any]]:
    """Per batch size: the engine's achieved TFLOP/s at its p50 and the share of the measured peak of its
    precision (FP16's for INT8/FP8 where those are not measured, FP32's for FP16) and of the datasheet's. An
    INT8/FP8 engine has no share of an FP32 peak (a CPU's): its integer kernels outrun it, so that share, past
    100 %, would say nothing. ``covers``: the share of the compute nodes whose FLOPs the audit counted
    (``share_covers_nodes``); under 1, ``flops_lower_bound`` says the FLOPs, and so the TFLOP/s, are a floor.
    An engine faster than the measured peak shows the peak was measured low: its row gives no share of it (one past
    100 % would be no fact) and says so in ``above_measured_peak``, the achieved rate being a floor of the peak."""
    measured, sheet = peak.get("measured", {}), peak.get("datasheet", {})
    kind = entry.precision if entry.precision in measured else ("fp16" if "fp16" in measured else "fp32")
    if kind == "fp32" and entry.precision in ("int8", "fp8"):
        kind = entry.precision  # not measured: no share
    out = {}
    for bs, lat in entry.latency_ms.items():
        tflops = flops_per_sample * int(bs) / (lat.p50 / 1e3) / 1e12
        row: dict[str, Any] = {"tflops": sig(tflops), "peak": kind, "flops_lower_bound": covers < 1.0}
        row["pct_of_measured_peak"] = row["pct_of_datasheet"] = None
        row["above_measured_peak"] = bool(measured.get(kind)) and tflops > measured[kind]
        if measured.get(kind) and not row["above_measured_peak"]:
            row["pct_of_measured_peak"] = sig(100 * tflops / measured[kind])
        if sheet.get(entry.precision):
            row["pct_of_datasheet"] = sig(100 * tflops / sheet[entry.precision])
        out[bs] = row
    return out
