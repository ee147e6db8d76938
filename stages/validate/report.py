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
            lines.append(f"| {e.name} | {e.precision} | not run: {e.reason or ''} |" + " |" * (5 + len(sizes)))
            continue
        lat = " | ".join(f"{e.latency_ms[s].p50:.3f}" for s in sizes)
        lines.append(f"| {e.name} | {e.precision} | {'yes' if e.passed else '**no**'} | "
                     f"{fmt(e.max_abs_err, '.2e')} | {fmt(e.cosine, '.6f')} | {fmt(e.top1_agreement)} | "
                     f"{fmt(e.accuracy)} | {lat} | {e.speedup_vs_baseline[sizes[-1]]:.2f} |")
    if v.failures:
        lines += ["", "### Gate failures", ""] + [f"- {f}" for f in v.failures]
    return lines
