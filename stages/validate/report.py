"""The validation section of report.md."""
from __future__ import annotations

from typing import Any

from kiln.core.records import ValidationResult
from kiln.core.text import fmt


def report_section(summary: dict[str, Any]) -> list[str]:
    if not summary.get("engines") and "baseline" not in summary:
        return []
    v = ValidationResult.parse(summary, "validate summary", hint="rerun `kiln run --force validate`")
    b = v.baseline
    sizes = list(b.latency_ms)
    lines = ["", "## Validation against PyTorch", "",
             f"Baseline: PyTorch FP32 on {b.device.upper()}, accuracy {fmt(b.accuracy)} on {b.samples} held-out "
             "samples.", "",
             "| engine | precision | passed | max abs err | cosine | top-1 agree | accuracy | "
             + " | ".join(f"p50 ms @{s}" for s in sizes) + f" | speedup @{sizes[-1]} |",
             "|---|---|---|---|---|---|---|" + "---|" * len(sizes) + "---|",
             "| pytorch (baseline) | fp32 | | | | | " + f"{fmt(b.accuracy)} | "
             + " | ".join(f"{b.latency_ms[s].p50:.3f}" for s in sizes) + " | 1.00 |"]
    for e in v.engines:
        if e.status != "validated":
            lines.append(f"| {e.name} | {e.precision} | not run here (targets {e.device.upper()}): {e.reason or ''} |"
                         + " |" * (5 + len(sizes)))
            continue
        g = e.gates
        lat = " | ".join(f"{e.latency_ms[s].p50:.3f}" for s in sizes[:-1])
        last = _gated(f"{e.latency_ms[sizes[-1]].p50:.3f}", "≤", g.get("max_latency_p50_ms"))
        drop = None if g.get("max_accuracy_drop") is None or b.accuracy is None else b.accuracy - g["max_accuracy_drop"]
        lines.append(f"| {e.name} | {e.precision} | {'yes' if e.passed else '**no**'} | "
                     f"{_gated(fmt(e.max_abs_err, '.2e'), '≤', g.get('max_abs_err'))} | "
                     f"{_gated(fmt(e.cosine, '.6f'), '≥', g.get('min_cosine'))} | "
                     f"{_gated(fmt(e.top1_agreement), '≥', g.get('min_top1_agreement'))} | "
                     f"{_gated(fmt(e.accuracy), '≥', None if drop is None else round(drop, 4))} | "
                     f"{lat + ' | ' if lat else ''}{last} | {e.speedup_vs_baseline[sizes[-1]]:.2f} |")
    if any(e.gates for e in v.engines):
        lines += ["", "Each value is followed by its gate in parentheses (`validate.gates`, per precision); a value "
                      "without one is not gated."]
    if v.failures:
        lines += ["", "### Gate failures", ""] + [f"- {f}" for f in v.failures]
    return lines + _speed_table(v)


def _gated(value: str, op: str, limit: float | None) -> str:
    return value if limit is None else f"{value} ({op} {limit:g})"


def _speed_table(v: ValidationResult) -> list[str]:
    """INT8/FP16 p50 speedup over the FP32 (and FP16) engine of the same backend and device, per batch size."""
    if not v.speed_vs_fp32:
        return []
    engines = {e.name: e for e in v.engines}
    out = ["", "### Reduced precision vs FP32, same backend and device", "",
           "| engine | vs FP32 (p50 speedup per batch) | INT8 vs FP16 | verdict |", "|---|---|---|---|"]
    for r in v.speed_vs_fp32:
        ratios = ", ".join(f"{x:.2f}x @{bs}" for bs, x in r["vs_fp32"].items())
        fp16 = ", ".join(f"{x:.2f}x @{bs}" for bs, x in r.get("vs_fp16", {}).items()) or "-"
        dropped = engines[r["engine"]].dropped if r["engine"] in engines else None
        verdict = f"**dropped**: {dropped}" if dropped else ("**slower than FP32**" if r["slower"] else "faster")
        out.append(f"| {r['engine']} | {ratios} | {fp16} | {verdict} |")
    return out
