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
             f"Baseline: {_reference(b)} on {b.device.upper()}, accuracy {fmt(b.accuracy)} on {b.samples} held-out "
             "samples.", *_compared(b), "",
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
    lines += _per_output(v)
    if v.failures:
        lines += ["", "### Gate failures", ""] + [f"- {f}" for f in v.failures]
    return lines + _speed_table(v)


def _reference(b: Any) -> str:
    return "ONNX Runtime FP32 (the input ONNX file)" if b.backend == "onnxruntime" else "PyTorch FP32"


def _compared(b: Any) -> list[str]:
    """What the engines were compared on: every output, the logits one (if any) for top-1 and accuracy."""
    if not b.compared:
        return []
    shapes = "; ".join(", ".join(f"{k}={n}" for k, n in p.items()) for p in b.shapes)
    logits = (f"top-1 agreement and accuracy on '{b.logits_output}'" if b.logits_output else
              "no class-logit output (validate.logits_output unset): no top-1 agreement or accuracy")
    return ["", f"Compared outputs: {', '.join(b.compared)} (error and cosine per output, the worst gated); {logits}."
            + (f" Dynamic axes validated at: {shapes}." if shapes else "")]


def _per_output(v: ValidationResult) -> list[str]:
    """Each output's worst statistics per engine, when the model has more than one output."""
    rows = [(e, name, s) for e in v.engines if e.status == "validated" and len(e.outputs) > 1
            for name, s in e.outputs.items()]
    if not rows:
        return []
    out = ["", "### Per output (worst over shapes and batch sizes)", "",
           "| engine | output | max abs err | rel err | cosine | top-1 agree |", "|---|---|---|---|---|---|"]
    for e, name, s in rows:
        out.append(f"| {e.name} | {name} | {fmt(s['max_abs_err'], '.2e')} | {fmt(s['rel_err'], '.2e')} | "
                   f"{fmt(s['cosine'], '.6f')} | {fmt(s['top1_agreement'])} |")
    return out


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
