"""PyTorch baselines: the trained model run the way a PyTorch user would run it, on the device each engine runs
on (a CPU baseline against a GPU engine would report the GPU's speedup as the engine's).

Kinds (``validate.baselines``): ``eager`` (the module as is) and ``compile`` (``torch.compile``; on a GPU with
``mode="max-autotune"``, Inductor's Triton kernels and CUDA graphs: the strongest plain-PyTorch path; on the CPU its
default mode, because max-autotune's benchmarking multiplies compile time for little gain there). ``dynamic=False``:
one graph per batch size, as the engines have one CUDA graph / profile per shape. Baselines run FP32 unless
``validate.baseline_precisions`` adds ``fp16`` (CUDA only: ``model.half()``, inputs cast).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kiln.core.data import Inputs, call, rebuild, tensors
from kiln.core.records import Baseline, Memory, Percentiles
from kiln.core.text import first_line
from kiln.core.timing import (
    MIN_ROUNDS,
    Timer,
    interleave,
    median_interval,
    ratio_interval,
    time_calls,
    warm_up,
)
from kiln.stages.validate.memory import PeakMemory, wait_a_sample


def time_torch(
    model: Callable[..., Any], x: Inputs, warmup: int, iterations: int, budget_s: float | None = None
) -> list[float]:
    """ms per call of ``model`` on ``x`` (a tensor, tuple or dict: kiln.core.data.call), timed like the engines
    (:func:`time_calls`): CUDA events around each call when ``x`` is on the GPU (the GPU's time, not the launch's),
    else wall clock."""
    cuda = tensors(x)[0].is_cuda
    with torch.inference_mode():
        # On the GPU every warm-up call runs (compiling and CUDA-graph capture need them; each is quick after)
        warm_up(lambda: call(model, x), warmup, None if cuda else budget_s)
        if cuda:
            torch.cuda.synchronize()
        return time_calls(lambda: call(model, x), iterations, cuda=cuda, budget_s=budget_s)


def weights_bytes(model: torch.nn.Module) -> int:
    """What the model occupies as stored weights: parameters and buffers."""
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def prepare(model: torch.nn.Module, kind: str, device: str, precision: str) -> torch.nn.Module:
    """A copy of ``model`` on ``device`` in ``precision``, compiled for ``kind`` ``compile`` (compiling happens at
    the first call, inside the warm-up)."""
    m = copy.deepcopy(model).eval().to(device)
    if precision == "fp16":
        m = m.half()
    if kind == "compile":
        mode = "max-autotune" if device == "cuda" else None
        m = torch.compile(m, mode=mode, dynamic=False)
    return m


def can_measure(device: str) -> str | None:
    """None when torch can run on ``device`` here; else why not."""
    if device == "cuda" and not torch.cuda.is_available():
        return "torch sees no CUDA GPU here (a CPU build of torch?)"
    return None


def prepare_baseline(
    model: torch.nn.Module,
    kind: str,
    device: str,
    precision: str,
    batches: dict[int, Any],
    warmup: int,
    samples: int,
    like: Inputs | None = None,
    budget_s: float | None = None,
) -> tuple[Baseline, dict[int, Timer]]:
    """The baseline ready to time: its record (peak memory while loading onto the device and warming up through
    every batch size) and a timer per batch size for :func:`kiln.core.timing.interleave`. On failure (e.g.
    torch.compile cannot compile this model here) the record says why and there are no timers."""
    base = Baseline(kind=kind, device=device, precision=precision, accuracy=None, samples=samples, latency_ms={})
    why = can_measure(device)
    if why:
        base.error = why
        return base, {}
    dtype = torch.float16 if precision == "fp16" else None
    timers: dict[int, Timer] = {}
    try:
        with PeakMemory(device) as mem:
            m = prepare(model, kind, device, precision)
            for bs, x in batches.items():  # an array, or a feed of named arrays in ``like``'s structure
                parts = [
                    torch.from_numpy(np.ascontiguousarray(a)).to(device)
                    for a in (x.values() if isinstance(x, dict) else [x])
                ]
                parts = [t.to(dtype) if dtype is not None and t.is_floating_point() else t for t in parts]
                xt = rebuild(like, parts) if like is not None else parts[0]
                time_torch(m, xt, max(warmup, 1), 1, budget_s)  # compiles, captures, warms up
                timers[bs] = _torch_timer(m, xt)
            wait_a_sample()
    except Exception as exc:  # reported, not fatal
        base.error = f"{type(exc).__name__}: {first_line(exc, 200)}"
        return base, {}
    size = weights_bytes(m)
    base.memory = Memory(peak_mb=_with_weights(mem.peak_mb, size), method=mem.method, size_bytes=size)
    return base, timers


def _with_weights(peak_mb: float | None, size_bytes: int) -> float | None:
    """The baseline's peak memory (load and largest batch, as the engines' figure is), at least the ``size_bytes`` of
    weights it holds: the copy of them made inside the meter is its load, and a sampled growth can fall short of it
    where the process frees other memory meanwhile. None (not measured) stays None."""
    if peak_mb is None:
        return None
    return max(peak_mb, float(f"{size_bytes / 2**20:.3g}"))


def measure(
    model: torch.nn.Module,
    kind: str,
    device: str,
    precision: str,
    batches: dict[int, Any],
    warmup: int,
    iterations: int,
    samples: int,
    like: Inputs | None = None,
    budget_s: float | None = None,
    rounds: int = MIN_ROUNDS,
) -> Baseline:
    """One baseline prepared and timed alone (no other contender to interleave with), in ``rounds`` rounds."""
    base, timers = prepare_baseline(model, kind, device, precision, batches, warmup, samples, like, budget_s)
    for bs, timer in timers.items():
        per_round = interleave({"b": timer}, rounds, max(1, iterations // rounds), budget_s or float("inf"))["b"]
        base.latency_ms[str(bs)] = from_rounds(per_round)
    return base


def _torch_timer(model: Callable[..., Any], x: Inputs) -> Timer:
    cuda = tensors(x)[0].is_cuda

    def timer(calls: int, budget_s: float | None) -> list[float]:
        with torch.inference_mode():
            return time_calls(lambda: call(model, x), calls, cuda=cuda, budget_s=budget_s, min_calls=1)

    return timer


def from_rounds(rounds: list[list[float]]) -> Percentiles:
    """Latency of interleaved rounds: p50 the median of the rounds' medians, with its 95 % interval from the same
    medians (:func:`median_interval`, which brackets their median); p90 and p99 of every call.

    The rounds, not the calls, are the independent measurements (a load that comes and goes slows a whole round),
    so the interval is of the rounds' medians, and p50 is the statistic it is an interval of: the median of every
    call pooled can fall outside it (two loaded rounds among twelve put it above the interval; the speedups pair
    the same round medians, :func:`kiln.core.timing.paired_ratio`). p90 and p99, of another statistic, are held to
    p50 and above so the three stay in order."""
    calls = [t for r in rounds for t in r]
    p = Percentiles.of(calls)
    medians = [float(np.median(r)) for r in rounds if r]
    if not medians:
        return p
    lo, hi = median_interval(medians)
    p.p50 = float(np.median(medians))
    p.p90 = max(p.p90, p.p50)
    p.p99 = max(p.p99, p.p90)
    p.ci95, p.rounds = (lo, hi), medians
    p.spread = (hi - lo) / p.p50 if p.p50 > 0 else None
    return p


def speedups(
    engine_device: str, latency: dict[str, Percentiles], baselines: list[Baseline]
) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, tuple[float, float]]]]:
    """p50 ratio per batch against every baseline measured on the engine's device, and its 95 % interval."""
    ratios: dict[str, dict[str, float]] = {}
    intervals: dict[str, dict[str, tuple[float, float]]] = {}
    for b in baselines:
        if b.device != engine_device or not b.latency_ms:
            continue
        ratios[b.label] = {bs: b.latency_ms[bs].over(lat) for bs, lat in latency.items() if bs in b.latency_ms}
        intervals[b.label] = {
            bs: ci
            for bs, lat in latency.items()
            if bs in b.latency_ms and (ci := ratio_interval(b.latency_ms[bs].rounds, lat.rounds)) is not None
        }
    return ratios, intervals
