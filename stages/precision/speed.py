"""Is a reduced-precision engine faster than the higher-precision engine of the same backend and device? What
users ask of quantization is faster and accurate at once, so an FP16 engine slower than FP32, or an INT8/FP8 engine
slower than FP32 or FP16, at the largest batch is flagged, and with
``precision.require_speedup`` dropped (validated, but not packaged).

Reads the latency the validate stage measured (p50 per batch size); it times nothing itself.
"""

from __future__ import annotations

from typing import Any

from kiln.core.records import EngineValidation
from kiln.core.timing import ratio_interval

REDUCED = ("int8", "fp8", "fp16")
LOWBIT = ("int8", "fp8")  # judged against FP16 where there is one: what they must beat to be worth serving


def speed_vs_fp32(engines: list[EngineValidation]) -> list[dict[str, Any]]:
    """One row per validated INT8/FP8/FP16 engine with an FP32 or (INT8/FP8) FP16 engine on the same backend and
    device: p50 speedups (its reference's p50 / its p50, > 1 is faster) per batch size against FP32 and, for INT8
    and FP8, against FP16. It is judged against the one of those it does worst against at the largest batch size
    (``judged_against``): ``slower`` when it loses there beyond the timing's noise (the 95 % interval of the ratio,
    paired round by round, lies below 1), ``within_noise`` when that interval holds 1."""
    timed = {(e.backend, e.device, e.precision): e for e in engines if e.status == "validated" and e.latency_ms}
    rows = []
    for (backend, device, precision), e in timed.items():
        fp32, fp16 = timed.get((backend, device, "fp32")), timed.get((backend, device, "fp16"))
        refs = [r for r in (fp32, fp16 if precision in LOWBIT else None) if r is not None]
        if precision not in REDUCED or not refs:
            continue
        sizes = sorted(e.latency_ms, key=int)
        row: dict[str, Any] = {
            "engine": e.name,
            "precision": precision,
            "largest_batch": sizes[-1],
            "vs_fp32": _ratios(fp32, e, sizes) if fp32 is not None else {},
            "vs_fp32_ci": _intervals(fp32, e, sizes) if fp32 is not None else {},
        }
        if precision in LOWBIT and fp16 is not None:
            row["vs_fp16"], row["vs_fp16_ci"] = _ratios(fp16, e, sizes), _intervals(fp16, e, sizes)
        # judged against the reference it does worst against: it must beat each to be worth serving
        judge = min(refs, key=lambda r: row[f"vs_{r.precision}"].get(sizes[-1], float("inf"))).precision
        row["judged_against"] = judge
        ratio, ci = row[f"vs_{judge}"].get(sizes[-1]), row[f"vs_{judge}_ci"].get(sizes[-1])
        # slower only where the interval says so (all of it below 1); one p50 against another is noise's to decide
        row["slower"] = ci[1] < 1.0 if ci is not None else ratio is not None and ratio < 1.0
        row["within_noise"] = ci is not None and ci[0] <= 1.0 <= ci[1]
        rows.append(row)
    return rows


def _ratios(ref: EngineValidation, e: EngineValidation, sizes: list[str]) -> dict[str, float]:
    return {bs: ref.latency_ms[bs].over(e.latency_ms[bs]) for bs in sizes if bs in ref.latency_ms}


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
            judge = r.get("judged_against", "fp32")
            why = (
                "INT8/FP8 must beat FP16"
                if judge == "fp16" and r["precision"] in LOWBIT
                else "precision.require_speedup"
            )
            e.dropped = (
                f"slower than {judge.upper()} at batch {r['largest_batch']} "
                f"({r[f'vs_{judge}'][r['largest_batch']]:.2f}x; {why})"
            )
    return sorted(slower)
