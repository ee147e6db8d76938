"""Is a reduced-precision engine faster than the FP32 engine of the same backend and device? What users ask
of quantization is faster and accurate at once, so an INT8/FP16 engine slower than FP32 at the largest batch
is flagged, and with ``precision.require_speedup`` dropped (validated, but not packaged).

Reads the latency the validate stage measured (p50 per batch size); it times nothing itself.
"""

from __future__ import annotations

from typing import Any

from kiln.core.records import EngineValidation
from kiln.core.timing import ratio_interval

REDUCED = ("int8", "fp16")


def speed_vs_fp32(engines: list[EngineValidation]) -> list[dict[str, Any]]:
    """One row per validated INT8/FP16 engine with an FP32 engine on the same backend and device: p50
    speedups (FP32 p50 / its p50, > 1 is faster) per batch size against FP32 and, for INT8, against FP16;
    ``slower`` when it loses to FP32 at the largest batch size beyond the timing's noise (the 95 % interval of the
    ratio, paired round by round, lies below 1), ``within_noise`` when that interval holds 1."""
    timed = {(e.backend, e.device, e.precision): e for e in engines if e.status == "validated" and e.latency_ms}
    rows = []
    for (backend, device, precision), e in timed.items():
        fp32 = timed.get((backend, device, "fp32"))
        if precision not in REDUCED or fp32 is None:
            continue
        sizes = sorted(e.latency_ms, key=int)
        row: dict[str, Any] = {
            "engine": e.name,
            "precision": precision,
            "largest_batch": sizes[-1],
            "vs_fp32": _ratios(fp32, e, sizes),
            "vs_fp32_ci": _intervals(fp32, e, sizes),
        }
        fp16 = timed.get((backend, device, "fp16"))
        if precision == "int8" and fp16 is not None:
            row["vs_fp16"] = _ratios(fp16, e, sizes)
        ci = row["vs_fp32_ci"].get(sizes[-1])
        # slower only where the interval says so (all of it below 1); one p50 against another is noise's to decide
        row["slower"] = ci[1] < 1.0 if ci is not None else row["vs_fp32"][sizes[-1]] < 1.0
        row["within_noise"] = ci is not None and ci[0] <= 1.0 <= ci[1]
        rows.append(row)
    return rows


def _ratios(ref: EngineValidation, e: EngineValidation, sizes: list[str]) -> dict[str, float]:
    return {bs: ref.latency_ms[bs].p50 / e.latency_ms[bs].p50 for bs in sizes if bs in ref.latency_ms}


def _intervals(ref: EngineValidation, e: EngineValidation, sizes: list[str]) -> dict[str, tuple[float, float]]:
    out = {}
    for bs in sizes:
        if bs in ref.latency_ms and (ci := ratio_interval(ref.latency_ms[bs].rounds, e.latency_ms[bs].rounds)):
            out[bs] = ci
    return out


def drop_slower(engines: list[EngineValidation], rows: list[dict[str, Any]]) -> list[str]:
    """Mark each engine a row flags as ``dropped`` (the package stage skips it); returns their names."""
    slower = {r["engine"]: r for r in rows if r["slower"]}
    for e in engines:
        r = slower.get(e.name)
        if r is not None:
            e.dropped = (
                f"slower than FP32 at batch {r['largest_batch']} "
                f"({r['vs_fp32'][r['largest_batch']]:.2f}x; precision.require_speedup)"
            )
    return sorted(slower)
