"""Kiln's optimize stage vs onnxsim, onnxslim and ONNX Runtime's offline optimizer (CPU).

For each model: export raw (dynamo, optimize=False), produce each peer's graph, then measure node count,
ONNX Runtime CPU latency (2 threads, ORT_ENABLE_ALL at load as a user would run it, batch 1 and 8, p50,
ratio to raw in the same run, variants interleaved round-robin so drift hits all alike) and max abs error
vs PyTorch. Writes <out>/optimize.json and <out>/optimize.md.

    python benchmarks/optimize_bench.py --out benchmarks/results           # full run (CPU, minutes)
    python benchmarks/optimize_bench.py --smoke --out /tmp/bench           # tiny, seconds
"""
from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import onnx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kiln.models.registry import build_model  # noqa: E402
from kiln.stages.export import export_onnx  # noqa: E402
from kiln.stages.optimize.api import optimize_model  # noqa: E402
from kiln.stages.optimize.config import OptimizeConfig  # noqa: E402

log = logging.getLogger("bench")
STANDARD = {"", "ai.onnx"}


def specs(smoke: bool, bert_layers: int) -> dict[str, tuple[dict, Callable[[int], torch.Tensor]]]:
    s = {"cnn": ({}, lambda b: torch.randn(b, 1, 8, 8)), "transformer": ({}, lambda b: torch.randn(b, 1, 8, 8)),
         "mlp_embed": ({}, lambda b: torch.randint(0, 17, (b, 64)))}
    if smoke:
        s["resnet18"] = ({"width": 8, "blocks": (1, 1)}, lambda b: torch.randn(b, 3, 32, 32))
        s["bert_base"] = ({"layers": 1, "dim": 64, "heads": 4, "ffn": 128, "in_features": 64, "seq_len": 16},
                          lambda b: torch.randn(b, 16, 64))
    else:
        s["resnet18"] = ({}, lambda b: torch.randn(b, 3, 224, 224))
        s["bert_base"] = ({"layers": bert_layers}, lambda b: torch.randn(b, 128, 768))
    return s


def peers(raw: Path, work: Path) -> dict[str, tuple[Path | None, str]]:
    """variant -> (path or None, note)"""
    out: dict[str, tuple[Path | None, str]] = {"raw": (raw, "")}
    model = onnx.load(str(raw))
    try:
        import onnxsim

        sim, ok = onnxsim.simplify(model)
        out["onnxsim"] = (_save(sim, work / "onnxsim.onnx"), "" if ok else "onnxsim check failed")
    except Exception as exc:
        out["onnxsim"] = (None, f"failed: {str(exc)[:150]}")
    try:
        import onnxslim

        out["onnxslim"] = (_save(onnxslim.slim(model), work / "onnxslim.onnx"), "")
    except Exception as exc:
        out["onnxslim"] = (None, f"failed: {str(exc)[:150]}")
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.optimized_model_filepath = str(work / "ort.onnx")
    so.log_severity_level = 3
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name", "ort.onnx.data")
    so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    ort.InferenceSession(str(raw), so, providers=["CPUExecutionProvider"])
    out["ort_offline"] = (work / "ort.onnx", "")
    t0 = time.perf_counter()
    kiln, summary = optimize_model(model, OptimizeConfig())
    note = f"optimize {time.perf_counter() - t0:.1f}s" + (f", rolled back {summary['rolled_back']}"
                                                            if summary["rolled_back"] else "")
    out["kiln"] = (_save(kiln, work / "kiln.onnx"), note)
    return out


def _save(m: onnx.ModelProto, path: Path) -> Path:
    onnx.save_model(m, str(path), save_as_external_data=True, location=path.name + ".data", size_threshold=1024)
    return path


def session(path: Path) -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = 2, 1
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def latency(sessions: dict[str, Any], feed_name: dict[str, str], x: np.ndarray, runs: int) -> dict[str, float]:
    """p50 ms per variant, measured round-robin (one run of each variant per round)."""
    times: dict[str, list[float]] = {k: [] for k in sessions}
    for s in sessions:  # warm-up
        sessions[s].run(None, {feed_name[s]: x})
    for _ in range(runs):
        for k, s in sessions.items():
            t0 = time.perf_counter()
            s.run(None, {feed_name[k]: x})
            times[k].append((time.perf_counter() - t0) * 1e3)
    return {k: float(np.median(v)) for k, v in times.items()}


def bench_model(name: str, params: dict, make: Callable[[int], torch.Tensor], runs: dict[int, int],
                root: Path) -> dict[str, Any]:
    torch.manual_seed(0)
    model = build_model(name, params).eval()
    work = root / name
    work.mkdir(parents=True, exist_ok=True)
    raw = work / "raw.onnx"
    export_onnx(model, make(2), raw)
    variants = peers(raw, work)
    res: dict[str, Any] = {"params": params, "variants": {}}
    sessions, names = {}, {}
    for v, (path, note) in variants.items():
        entry: dict[str, Any] = {"note": note}
        res["variants"][v] = entry
        if path is None:
            continue
        m = onnx.load(str(path), load_external_data=False)
        entry["nodes"] = len(m.graph.node)
        entry["nonstandard_ops"] = sorted({f"{n.domain}:{n.op_type}" for n in m.graph.node if n.domain not in STANDARD})
        sessions[v] = session(path)
        names[v] = sessions[v].get_inputs()[0].name
    x_err = make(8)
    with torch.no_grad():
        ref = model(x_err).numpy()
    for v, s in sessions.items():
        got = s.run(None, {names[v]: x_err.numpy()})[0]
        res["variants"][v]["max_abs_err"] = float(np.max(np.abs(got - ref)))
        res["variants"][v]["rel_err"] = float(np.max(np.abs(got - ref)) / max(1e-12, float(np.abs(ref).max())))
    for batch, n in runs.items():
        x = make(batch).numpy()
        p50 = latency(sessions, names, x, n)
        for v, ms in p50.items():
            res["variants"][v][f"p50_ms_b{batch}"] = round(ms, 4)
            res["variants"][v][f"ratio_b{batch}"] = round(ms / p50["raw"], 3)
    log.info("%s done", name)
    return res


def markdown(results: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = ["# Optimize benchmark: Kiln vs onnxsim, onnxslim, ONNX Runtime offline", "",
             f"{meta['when']} · {meta['machine']} · ORT {meta['onnxruntime']} · 2 threads · p50 of "
             f"{meta['runs']} round-robin runs · ratio = p50 / raw p50 in the same run", "",
             "| model | variant | nodes | non-standard ops | p50 b1 ms (ratio) | p50 b8 ms (ratio) | max abs err vs torch |",
             "|---|---|---|---|---|---|---|"]
    for model, r in results.items():
        for v, e in r["variants"].items():
            if "nodes" not in e:
                lines.append(f"| {model} | {v} | - | - | - | - | {e['note']} |")
                continue
            lines.append(f"| {model} | {v} | {e['nodes']} | {', '.join(e['nonstandard_ops']) or '-'} | "
                         f"{e['p50_ms_b1']:.3f} ({e['ratio_b1']:.2f}) | {e['p50_ms_b8']:.3f} ({e['ratio_b8']:.2f}) | "
                         f"{e['max_abs_err']:.2e} |")
    return "\n".join(lines + [""] + verdicts(results) + ["", NOTES]) + "\n"


NOTES = """## Notes
- Node counts compare graphs, not work: onnxsim 0.8 fuses attention into `com.microsoft:Attention` and ORT's
  offline model contains ORT-only ops (FusedMatMul, SkipLayerNormalization, FusedGemm, NCHWc convs); neither
  file is portable (TensorRT's parser rejects com.microsoft ops). Kiln emits standard ONNX only, so the
  fair node-count target is the best *standard-only* peer; the table above shows both.
- Kiln keeps the attention core as MatMul -> Softmax -> MatMul (the form TensorRT fuses into its MHA kernel)
  and the opset-18 GELU as the canonical Div/Erf/Add/Mul/Mul chain (ORT then fuses it into BiasGelu);
  with opset >= 20 it becomes one `Gelu` node.
- Latency is ORT CPU with ORT_ENABLE_ALL at load for every variant, so ORT re-optimizes each file; the
  ratio to raw is what a user of each tool would see. Differences of a few percent are within run noise;
  resnet18 and bert_base get few runs (see json) on a shared 2-core machine, so their ratios are noisier.
- Where ort_offline beats Kiln on a CNN at batch 8, it is ORT's NCHWc layout (com.microsoft.nchwc ops with
  weights already reordered in the file): a CPU-specific, non-standard rewrite Kiln does not emit.
- Kiln's own node count on transformer/bert is above onnxsim's and ORT's because those peers use contrib
  ops (Attention; FusedMatMul folds K's Transpose, SkipLayerNormalization folds the residual Add) that
  standard ONNX cannot express.
"""


def verdicts(results: dict[str, Any]) -> list[str]:
    """Per model: Kiln vs the best peer on nodes (all peers and standard-op-only peers) and latency."""
    out = ["## Targets", "", "| model | kiln nodes | best peer nodes (any) | best standard-only peer | "
           "kiln b1 / best peer b1 | kiln b8 / best peer b8 | kiln rel err |", "|---|---|---|---|---|---|---|"]
    for model, r in results.items():
        v = r["variants"]
        if "nodes" not in v.get("kiln", {}):
            continue
        peers = {k: e for k, e in v.items() if k not in ("raw", "kiln") and "nodes" in e}
        best_any = min(peers.items(), key=lambda kv: kv[1]["nodes"])
        std = {k: e for k, e in peers.items() if not e["nonstandard_ops"]}
        best_std = min(std.items(), key=lambda kv: kv[1]["nodes"]) if std else None
        b1 = v["kiln"]["p50_ms_b1"] / min(e["p50_ms_b1"] for e in peers.values())
        b8 = v["kiln"]["p50_ms_b8"] / min(e["p50_ms_b8"] for e in peers.values())
        out.append(f"| {model} | {v['kiln']['nodes']} | {best_any[1]['nodes']} ({best_any[0]}) | "
                   f"{best_std[1]['nodes'] if best_std else '-'} ({best_std[0] if best_std else '-'}) | "
                   f"{b1:.2f} | {b8:.2f} | {v['kiln']['rel_err']:.1e} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--smoke", action="store_true", help="tiny resnet/bert, few runs")
    ap.add_argument("--models", nargs="*", help="subset of models")
    ap.add_argument("--bert-layers", type=int, default=12)
    ap.add_argument("--render", action="store_true", help="only rewrite <out>/optimize.md from its json")
    ap.add_argument("--runs", type=int, default=0, help="runs per batch size (default: by model size)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import onnxruntime as ort

    if args.render:
        data = json.loads((args.out / "optimize.json").read_text())
        (args.out / "optimize.md").write_text(markdown(data["results"], data["meta"]))
        print((args.out / "optimize.md").read_text())
        return
    all_specs = specs(args.smoke, args.bert_layers)
    chosen = args.models or list(all_specs)
    results: dict[str, Any] = {}
    default_runs = {"cnn": {1: 200, 8: 200}, "transformer": {1: 200, 8: 200}, "mlp_embed": {1: 300, 8: 300},
                    "resnet18": {1: 30, 8: 10}, "bert_base": {1: 15, 8: 5}}
    with tempfile.TemporaryDirectory(prefix="kiln-optbench-") as tmp:
        for name in chosen:
            params, make = all_specs[name]
            runs = {b: (args.runs or (5 if args.smoke else default_runs[name][b])) for b in (1, 8)}
            results[name] = bench_model(name, params, make, runs, Path(tmp))
            results[name]["runs"] = runs
    meta = {"when": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{platform.machine()} CPU, {platform.python_version()}",
            "onnxruntime": ort.__version__, "torch": torch.__version__, "smoke": args.smoke,
            "bert_layers": args.bert_layers, "runs": "per model (see json)"}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "optimize.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    md = markdown(results, meta)
    (args.out / "optimize.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
