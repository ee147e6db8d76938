"""report.json (machine-readable) and report.md (for people), written into the workdir after every run."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.core.artifacts import write_json_atomic, write_text_atomic
from kiln.config import KilnConfig
from kiln.core.env import environment
from kiln.fingerprints import FINGERPRINTS
from kiln.runner import RunResult, cache_key, outputs_intact, read_manifest
from kiln.stage_list import STAGE_NAMES, stage_named


def build_report(result: RunResult, config: KilnConfig, workdir: Path | None = None) -> dict[str, Any]:
    """This run's stages, plus (with ``workdir``) the stages it did not touch as their manifests left them, so a
    one-stage command (`kiln package`) does not shrink the report to that stage."""
    ran = {r.name: {"status": r.status, "seconds": round(r.seconds, 3), **({"error": r.error} if r.error else {}),
                    **({"original_seconds": round(r.original_seconds, 3)} if r.original_seconds is not None else {}),
                    "summary": r.summary} for r in result.records}
    stages: dict[str, Any] = {}
    for name in STAGE_NAMES:
        if name in ran:
            stages[name] = ran[name]
        elif workdir is not None and (m := read_manifest(workdir / name)) is not None:
            status = "kept" if _current(name, m, config, workdir) else "stale"
            stages[name] = {"status": status, "seconds": 0.0, "original_seconds": round(m.get("seconds", 0.0), 3),
                            "summary": m.get("summary", {})}
    validation = stages.get("validate", {}).get("summary") or None
    if stages.get("validate", {}).get("status") == "stale":
        validation = None  # results of other settings or engines: not this configuration's verdict
    ok = result.ok and (validation or {}).get("passed") is not False
    report: dict[str, Any] = {"name": config.name, "ok": ok, "stages": stages, "environment": environment()}
    if result.error is not None:
        report["error"] = str(result.error)
    if validation:
        report["validation"] = {k: validation[k] for k in ("passed", "baseline", "engines", "failures")}
        report["validation"]["speed_vs_fp32"] = validation.get("speed_vs_fp32", [])
    return report


def _current(name: str, manifest: dict[str, Any], config: KilnConfig, workdir: Path) -> bool:
    """Would this configuration reuse the stage's results (same settings, code and inputs, files intact)? User
    data is not re-read for this: a one-stage command must not load a dataset or run a reader it does not use."""
    no_data = {fingerprint: None for fingerprint in FINGERPRINTS}
    try:
        _, parts = cache_key(stage_named(name), config, workdir, no_data)
    except Exception:  # e.g. a user module that no longer imports: certainly not current
        return False
    recorded = {k: v for k, v in manifest.get("key_parts", {}).items() if k != "user_data"}
    return parts == recorded and outputs_intact(workdir / name, manifest)


def _fmt(v: Any, spec: str = ".4f") -> str:
    return "-" if v is None else format(v, spec)


def render_markdown(report: dict[str, Any]) -> str:
    lines = [f"# Kiln report: {report['name']}", "", f"**Result: {'PASSED' if report['ok'] else 'FAILED'}**", ""]
    if "error" in report:
        lines += [f"> {report['error']}", ""]
    lines += ["## Stages", "", "| stage | status | seconds |", "|---|---|---|"]
    lines += [f"| {n} | {s['status']} | {s['seconds']:.2f} |" for n, s in report["stages"].items()]
    if any(s["status"] == "kept" for s in report["stages"].values()):
        lines += ["", "*kept*: not part of this command; its results are those already in the workdir."]
    if any(s["status"] == "stale" for s in report["stages"].values()):
        lines += ["", "*stale*: not part of this command, and made with other settings or inputs than this "
                      "configuration's: `kiln run` redoes it."]
    v = report.get("validation")
    if v:
        b = v["baseline"]
        sizes = list(b["latency_ms"])
        lines += ["", "## Validation against PyTorch", "",
                  f"Baseline: PyTorch FP32 on CPU, accuracy {b['accuracy']:.4f} on {b['samples']} held-out samples.", "",
                  "| engine | precision | passed | max abs err | cosine | top-1 agree | accuracy | "
                  + " | ".join(f"p50 ms @{s}" for s in sizes) + f" | speedup @{sizes[-1]} |",
                  "|---|---|---|---|---|---|---|" + "---|" * len(sizes) + "---|"]
        lines.append("| pytorch (baseline) | fp32 | | | | | " + f"{b['accuracy']:.4f} | "
                     + " | ".join(f"{b['latency_ms'][s]['p50']:.3f}" for s in sizes) + " | 1.00 |")
        for e in v["engines"]:
            if e.get("status") != "validated":
                lines.append(f"| {e['name']} | {e['precision']} | not run: {e.get('reason', '')} |" + " |" * (5 + len(sizes)))
                continue
            lat = " | ".join(f"{e['latency_ms'][s]['p50']:.3f}" for s in sizes)
            lines.append(f"| {e['name']} | {e['precision']} | {'yes' if e['passed'] else '**no**'} | "
                         f"{e['max_abs_err']:.2e} | {_fmt(e['cosine'], '.6f')} | {e['top1_agreement']:.4f} | "
                         f"{e['accuracy']:.4f} | {lat} | {e['speedup_vs_baseline'][sizes[-1]]:.2f} |")
        if v["failures"]:
            lines += ["", "### Gate failures", ""] + [f"- {f}" for f in v["failures"]]
        lines += _speed_table(v.get("speed_vs_fp32", []), {e["name"]: e for e in v["engines"]})
    lines += _stage_sections(report["stages"])
    env = report["environment"]
    lines += ["", "## Environment", "", ", ".join(f"{k} {v}" for k, v in env["versions"].items()),
              f"python {env['python']}, GPU: {env.get('gpu', 'none')}", ""]
    return "\n".join(lines)


def _stage_sections(stages: dict[str, Any]) -> list[str]:
    """Short per-stage facts for people: training result, graph size, precision choices, engines."""
    out: list[str] = []
    train = stages.get("train", {}).get("summary", {})
    if train.get("val_accuracy") is not None:
        out += ["", "## Training", "",
                f"{train.get('precision')} on {train.get('device')}, {train.get('steps', '?')} steps: final loss "
                f"{_fmt(train.get('final_loss'))}, validation accuracy {_fmt(train.get('val_accuracy'))}"
                + (f", {train['skipped_steps']} overflow-skipped steps" if train.get("skipped_steps") else "") + "."]
        if "loss.png" in train.get("files", []):
            out += ["", "![loss curve](train/loss.png)"]
    opt = stages.get("optimize", {}).get("summary", {})
    if "nodes_before" in opt:
        fired = [p["name"] for p in opt.get("passes", []) if p.get("nodes_before") != p.get("nodes_after")]
        out += ["", "## Graph optimization", "",
                f"{opt['nodes_before']} -> {opt['nodes_after']} nodes; passes that changed the graph: "
                f"{', '.join(dict.fromkeys(fired)) or 'none'}; rolled back: {', '.join(opt.get('rolled_back', [])) or 'none'}."]
    precision = stages.get("precision", {}).get("summary", {})
    variants = precision.get("variants", {})
    if variants:
        out += ["", "## Precision variants", "", "| variant | nodes kept in FP32 | top-1 agreement vs FP32 graph |", "|---|---|---|"]
        out += [f"| {name} | {v.get('kept_fp32', 0)} | {_fmt(v.get('top1_agreement'))} |" for name, v in variants.items()]
        out += [f"| {name} | **failed, not built** | - |" for name in precision.get("failed", {})]
        for name, v in variants.items():
            if "ort_cpu_scheme" in v:
                out += ["", f"ONNX Runtime CPU engines of `{name}` load a graph of their own, quantized "
                            f"**{v['ort_cpu_scheme']}** (`calibration.ort_cpu_scheme`), checked on its own: top-1 "
                            f"agreement {_fmt(v.get('ort_cpu_top1_agreement'))} with {v.get('ort_cpu_kept_fp32', 0)} "
                            "nodes kept in float."]
        out += [f"- **{name} failed**: {why}" for name, why in precision.get("failed", {}).items()]
        out += _kept_nodes_table(variants)
        if precision.get("node_error_plot"):
            out += ["", f"![per-node error vs FP32](precision/{precision['node_error_plot']})", ""]
            out += [f"- {name}: first node over {precision['node_error_threshold']:g} relative error: "
                    + (f"`{hit['node']}` ({hit.get('module') or 'module unknown'}), {hit['error']:.3g}" if hit
                       else "none") for name, hit in precision.get("first_divergence", {}).items()]
    build = stages.get("build", {}).get("summary", {})
    if build.get("engines"):
        out += ["", "## Engines", "", "| engine | backend | device | precision | build s | size MB |", "|---|---|---|---|---|---|"]
        out += [f"| {e['name']} | {e['backend']} | {e.get('device', '')} | {e['precision']} | "
                f"{_fmt(e.get('build_seconds'), '.2f')} | {_fmt((e.get('size_bytes') or 0) / 1e6, '.2f')} |"
                for e in build["engines"]]
        out += [f"- not built: {s}" for s in build.get("skipped", [])]
    return out


def _speed_table(rows: list[dict[str, Any]], engines: dict[str, Any]) -> list[str]:
    """INT8/FP16 p50 speedup over the FP32 (and FP16) engine of the same backend and device, per batch size."""
    if not rows:
        return []
    out = ["", "### Reduced precision vs FP32, same backend and device", "",
           "| engine | vs FP32 (p50 speedup per batch) | INT8 vs FP16 | verdict |", "|---|---|---|---|"]
    for r in rows:
        ratios = ", ".join(f"{x:.2f}x @{bs}" for bs, x in r["vs_fp32"].items())
        fp16 = ", ".join(f"{x:.2f}x @{bs}" for bs, x in r.get("vs_fp16", {}).items()) or "-"
        dropped = engines.get(r["engine"], {}).get("dropped")
        verdict = f"**dropped**: {dropped}" if dropped else ("**slower than FP32**" if r["slower"] else "faster")
        out.append(f"| {r['engine']} | {ratios} | {fp16} | {verdict} |")
    return out


def _kept_nodes_table(variants: dict[str, Any], limit: int = 40) -> list[str]:
    """Each node kept in FP32 (or float, for INT8), with the PyTorch module the exporter recorded for it."""
    rows = []
    for name, v in variants.items():
        for label, nodes, modules in ((name, v.get("kept_fp32_nodes", {}), v.get("kept_fp32_modules", {})),
                                      (f"{name} onnxruntime-cpu", v.get("ort_cpu_kept_fp32_nodes", {}),
                                       v.get("ort_cpu_kept_fp32_modules", {}))):
            rows += [f"| {label} | `{node}` | {modules.get(node, '-')} | {why} |" for node, why in nodes.items()]
    if not rows:
        return []
    more = ["", f"... and {len(rows) - limit} more (see precision/variants.json)"] if len(rows) > limit else []
    return ["", "Nodes kept in FP32:", "", "| variant | ONNX node | PyTorch module | why |", "|---|---|---|---|",
            *rows[:limit], *more]


def write_report(result: RunResult, config: KilnConfig, workdir: Path) -> dict[str, Any]:
    report = build_report(result, config, workdir)
    write_json_atomic(workdir / "report.json", report, sort_keys=False)  # keep stages in pipeline order
    write_text_atomic(workdir / "report.md", render_markdown(report))
    return report
