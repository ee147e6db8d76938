"""Precision variants, measured side by side in one run.

CPU mode (default): ONNX Runtime CPU, 2 threads, batch 8. For the zoo ``cnn`` and ``transformer`` (trained
briefly on digits) and wider variants of both: Kiln's FP32 engine vs its INT8 graphs (session graph
optimisation ALL, so ORT fuses DQ->op->Q into QLinear / integer kernels): the symmetric Q/DQ graph TensorRT
takes, and both ONNX Runtime CPU schemes (static uint8, dynamic), marking the one ``auto`` picks. Latency: median
and p90 of timed runs,
FP32 and INT8 interleaved in rounds so both see the same machine state. Accuracy on the digits held-out split,
top-1 agreement of INT8 with FP32. Targets: INT8 >= 1.5x faster, agreement >= 99%, accuracy within 1 point.

GPU mode (``--gpu``, GPU host with onnxruntime-gpu): FP16 graphs of ``resnet18`` (3x224x224) and ``bert_base``
(128x768) with random weights on ORT CUDA vs PyTorch FP32 (TF32 off) on ``--samples`` random inputs. Target:
top-1 agreement >= 99.5%. Latency of ORT CUDA FP32 / FP16 (session.run with host arrays, so copies included).

    python benchmarks/precision_bench.py --out benchmarks/results                    # CPU
    PYTHONPATH=/tmp/site:$PWD python benchmarks/precision_bench.py --gpu --out $OUT   # GPU host
    python benchmarks/precision_bench.py --smoke [--gpu] --out /tmp/pb               # tiny, CPU
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
from typing import Any

import numpy as np
import onnx
import torch

from kiln.calibration.config import CalibrationConfig  # noqa: E402
from kiln.calibration.quantize import quantizable_op_types  # noqa: E402
from kiln.core.cpu_int8 import ask_exact_int8, int8_kernels  # noqa: E402
from kiln.models.registry import build_model  # noqa: E402
from kiln.stages.export.torch_export import export_onnx  # noqa: E402
from kiln.stages.precision.compare import output_metrics  # noqa: E402
from kiln.stages.precision.config import FallbackConfig, FP16Config  # noqa: E402
from kiln.stages.precision.fp16 import convert_fp16  # noqa: E402
from kiln.stages.precision.fp16_select import select_fp32_nodes  # noqa: E402
from kiln.stages.precision.variants import Source, build_int8, ort_cpu_with_fallback  # noqa: E402

T0 = time.perf_counter()


def say(msg: str) -> None:
    print(f"[+{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def optimized(model: onnx.ModelProto) -> tuple[onnx.ModelProto, str]:
    """Kiln's optimize stage (default passes); if it fails, constant folding only — and the row says so."""
    try:
        from kiln.stages.optimize.config import OptimizeConfig
        from kiln.stages.optimize.stage import optimize_model  # type: ignore[attr-defined]

        return optimize_model(model, OptimizeConfig())[0], "kiln optimize (default passes)"
    except Exception as exc:  # another stage's failure must not hide this benchmark's numbers
        import onnx_graphsurgeon as gs

        graph = gs.import_onnx(model)
        graph.fold_constants().cleanup().toposort()
        out = gs.export_onnx(graph)
        out.ir_version = model.ir_version
        return out, f"constant folding only (optimize stage failed: {type(exc).__name__}: {str(exc)[:80]})"


def session(model: Path | onnx.ModelProto, threads: int, providers: list[str]) -> Any:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 3
    ask_exact_int8(opts)  # the INT8 kernels Kiln's own sessions use here (kiln.core.cpu_int8)
    src = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(src, opts, providers=providers)


def predict(sess: Any, x: np.ndarray, batch: int = 64) -> np.ndarray:
    name = sess.get_inputs()[0].name
    return np.concatenate([sess.run(None, {name: x[i : i + batch]})[0] for i in range(0, len(x), batch)])


def interleaved_latency(
    sessions: dict[str, Any], x: np.ndarray, rounds: int, per_round: int, warmup: int
) -> dict[str, dict[str, Any]]:
    """ms per batch; the variants take turns in rounds so drift (turbo, other processes on a shared machine)
    hits all alike. ``round_p50_ms``: each round's median, so speedups can be taken round by round."""
    times: dict[str, list[list[float]]] = {k: [] for k in sessions}
    feeds = {k: {s.get_inputs()[0].name: x} for k, s in sessions.items()}
    for k, s in sessions.items():
        for _ in range(warmup):
            s.run(None, feeds[k])
    for _ in range(rounds):
        for k, s in sessions.items():
            this = []
            for _ in range(per_round):
                t = time.perf_counter()
                s.run(None, feeds[k])
                this.append((time.perf_counter() - t) * 1e3)
            times[k].append(this)
    out = {}
    for k, per in times.items():
        flat = [t for r in per for t in r]
        out[k] = {
            "p50_ms": float(np.median(flat)),
            "p90_ms": float(np.percentile(flat, 90)),
            "runs": len(flat),
            "round_p50_ms": [float(np.median(r)) for r in per],
        }
    return out


def speedup(lat: dict[str, dict[str, Any]], base: str, other: str) -> float:
    """Median over rounds of (base / other) round medians: robust to load that comes and goes between rounds."""
    return float(np.median(np.array(lat[base]["round_p50_ms"]) / np.array(lat[other]["round_p50_ms"])))


# ---------------------------------------------------------------- CPU: INT8 vs FP32
CPU_ROWS = {  # row -> (zoo model, params, epochs, lr); "wide" rows: INT8 arithmetic outweighs per-op overhead
    "cnn": ("cnn", {}, 8, 3e-3),
    "transformer": ("transformer", {}, 8, 3e-3),
    "cnn-w64": ("cnn", {"width": 64}, 4, 3e-3),
    "transformer-d256": ("transformer", {"dim": 256, "heads": 4}, 15, 1e-3),
}


def cpu_row(row: str, smoke: bool, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    from kiln.models.datasets import digits
    from kiln.stages.train.config import TrainConfig
    from kiln.stages.train.loop import evaluate, train

    name, params, epochs, lr = CPU_ROWS[row]
    data = digits()
    torch.manual_seed(0)
    model = build_model(name, params)
    epochs = 1 if smoke else (args.epochs or epochs)
    train(model, data, TrainConfig(epochs=epochs, device="cpu", precision="fp32", lr=lr), seed=0)
    torch_acc = evaluate(model, data.val_x, data.val_y, torch.device("cpu"))
    say(f"{row}: trained {epochs} epochs, PyTorch val accuracy {torch_acc:.4f}")
    proto, how = optimized(export_onnx(model, data.val_x[:2], work / f"{row}.onnx"))
    from kiln.calibration.data import calibration_batches

    # Kiln's INT8 variant as the pipeline builds it: the symmetric int8 Q/DQ graph (what TensorRT runs) plus the
    # graph ORT CPU engines load, quantized by calibration.ort_cpu_scheme=auto. The other ORT CPU scheme is
    # built too, so the table shows what auto chose against.
    ccfg = CalibrationConfig(method=args.method)
    x_val, y_val = data.val_x.numpy(), data.val_y.numpy()
    src = Source.prepare(proto, work / f"{row}_fp32.onnx", calibration_batches(data, ccfg), work / "cache")
    entry = build_int8(src, work / row / "int8.onnx", ccfg, FallbackConfig(min_top1_agreement=0.99), x_val)
    chosen = entry["ort_cpu"]["scheme"]
    paths = {"int8": work / row / "int8.onnx", f"ort_cpu_{chosen}": work / row / "model.ort_cpu.onnx"}
    other = "static" if chosen == "dynamic" else "dynamic"
    # The other scheme as Kiln would build it: from the Q/DQ graph's float nodes, through its own fallback.
    ops = set(quantizable_op_types(ccfg))
    other_entry = ort_cpu_with_fallback(
        src,
        work / row / f"ort_cpu_{other}.onnx",
        ccfg.model_copy(update={"ort_cpu_scheme": other}),
        FallbackConfig(min_top1_agreement=0.99),
        x_val,
        entry["reasons"],
        {n.name for n in src.model.graph.node if n.op_type in ops},
    )
    built = {"int8": entry, f"ort_cpu_{chosen}": entry["ort_cpu"], f"ort_cpu_{other}": other_entry}
    paths[f"ort_cpu_{other}"] = work / row / f"ort_cpu_{other}.onnx"
    sessions = {"fp32": session(src.path, 2, ["CPUExecutionProvider"])}
    sessions |= {k: session(p, 2, ["CPUExecutionProvider"]) for k, p in paths.items()}
    logits = {k: predict(s, x_val) for k, s in sessions.items()}
    acc = {k: float(np.mean(v.argmax(1) == y_val)) for k, v in logits.items()}
    lat = interleaved_latency(
        sessions, x_val[:8], rounds=3 if smoke else 20, per_round=10 if smoke else 50, warmup=5 if smoke else 30
    )
    res = {
        "row": row,
        "model": name,
        "params": params,
        "graph": how,
        "epochs": epochs,
        "torch_accuracy": torch_acc,
        "accuracy_fp32": acc["fp32"],
        "latency": lat,
        "calibration": args.method,
        "batch": 8,
        "threads": 2,
        "variants": {},
        "kiln_ort_cpu": f"ort_cpu_{chosen}",
    }
    for flavour in paths:
        agree = output_metrics(logits["fp32"], logits[flavour])
        ratio = speedup(lat, "fp32", flavour)
        delta = 100 * (acc[flavour] - acc["fp32"])
        res["variants"][flavour] = {
            "accuracy": acc[flavour],
            "accuracy_delta_points": delta,
            "top1_agreement": agree["top1_agreement"],
            "cosine": agree["cosine"],
            "speedup": ratio,
            "kept_fp32": built[flavour]["kept_fp32"],
            "fallback_rounds": len(built[flavour]["fallback"]["rounds"]) - 1,
            "kiln_ort_cpu_engine": flavour == res["kiln_ort_cpu"],
            "targets_met": {
                "speedup>=1.5": ratio >= 1.5,
                "agreement>=0.99": agree["top1_agreement"] >= 0.99,
                "accuracy_within_1pt": abs(delta) <= 1.0,
            },
        }
        say(
            f"{row} {flavour}: fp32 {lat['fp32']['p50_ms']:.3f} ms, {lat[flavour]['p50_ms']:.3f} ms ({ratio:.2f}x), "
            f"agreement {agree['top1_agreement']:.4f}, acc {acc['fp32']:.4f} -> {acc[flavour]:.4f}"
        )
    return res


# ---------------------------------------------------------------- GPU: FP16 vs PyTorch FP32
def gpu_specs(smoke: bool) -> dict[str, tuple[dict[str, Any], tuple[int, ...]]]:
    if smoke:
        return {
            "resnet18": ({"width": 8, "blocks": (1, 1), "num_classes": 10}, (3, 32, 32)),
            "bert_base": ({"layers": 1, "dim": 64, "heads": 4, "ffn": 128, "in_features": 64, "seq_len": 16}, (16, 64)),
        }
    return {"resnet18": ({}, (3, 224, 224)), "bert_base": ({}, (128, 768))}


def gpu_row(
    name: str, params: dict[str, Any], shape: tuple[int, ...], smoke: bool, work: Path, args: argparse.Namespace
) -> dict[str, Any]:
    import onnxruntime as ort

    cuda = "CUDAExecutionProvider" in ort.get_available_providers() and torch.cuda.is_available()
    if not cuda and not smoke:
        raise SystemExit("--gpu needs onnxruntime-gpu with CUDAExecutionProvider and a CUDA torch")
    dev = torch.device("cuda" if cuda else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    model = build_model(name, params).eval()
    gen = torch.Generator().manual_seed(1)
    n = 32 if smoke else args.samples
    x = torch.randn((n, *shape), generator=gen)
    say(f"{name}: exporting")
    proto, how = optimized(export_onnx(model, x[:2], work / f"{name}.onnx"))
    src = Source.prepare(proto, work / f"{name}_fp32.onnx", [x[i : i + 8].numpy() for i in (0, 8)], work / "cache")
    cfg = FP16Config()
    amax = src.ranges("minmax", CalibrationConfig()).amax()
    keep = select_fp32_nodes(src.model, cfg, amax)
    fp16, info = convert_fp16(src.model, set(keep), cfg)
    fp16_path = work / f"{name}_fp16.onnx"
    onnx.save(fp16, fp16_path, save_as_external_data=True, location=fp16_path.name + ".data")
    say(f"{name}: fp16 graph with {len(keep)} nodes kept FP32, {info['casts']} casts")
    with torch.no_grad():
        model.to(dev)
        ref = np.concatenate([model(x[i : i + 32].to(dev)).float().cpu().numpy() for i in range(0, n, 32)])
    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if cuda else ["CPUExecutionProvider"]
    sessions = {"ort_fp32": session(src.path, 0, providers), "ort_fp16": session(fp16_path, 0, providers)}
    out = {
        "model": name,
        "params": {k: list(v) if isinstance(v, tuple) else v for k, v in params.items()},
        "input_shape": list(shape),
        "graph": how,
        "samples": n,
        "device": "cuda" if cuda else "cpu (smoke)",
        "kept_fp32": len(keep),
        "kept_ops": sorted({r.split(" ")[0] for r in keep.values()}),
        "casts": info["casts"],
    }
    for k, s in sessions.items():
        out[f"{k}_vs_torch_fp32"] = output_metrics(ref, predict(s, x.numpy(), batch=32))
    for b in (1, 32):
        xb = x[:b].numpy()
        out[f"latency_b{b}"] = interleaved_latency(
            sessions, xb, rounds=2 if smoke else 5, per_round=5 if smoke else 20, warmup=3 if smoke else 10
        )
        out[f"speedup_fp16_b{b}"] = speedup(out[f"latency_b{b}"], "ort_fp32", "ort_fp16")
    agree = out["ort_fp16_vs_torch_fp32"]["top1_agreement"]
    out["targets_met"] = {"fp16_agreement>=0.995": agree >= 0.995}
    say(f"{name}: ORT fp16 vs torch fp32 agreement {agree:.4f}, cosine {out['ort_fp16_vs_torch_fp32']['cosine']:.6f}")
    return out


# ---------------------------------------------------------------- report
def markdown(results: dict[str, Any]) -> str:
    lines = [
        f"# Precision benchmark ({results['mode']})",
        "",
        f"Command: `{results['command']}`  ",
        f"Host: {results['host']}, onnxruntime {results['onnxruntime']}, torch {results['torch']}, INT8 "
        f"kernels {results.get('cpu_int8_kernels', 'not recorded')}",
        "",
    ]
    if results["mode"].startswith("cpu"):
        lines += [
            "ORT CPU, 2 threads, batch 8, graph optimisation ALL; latency median (p90) over interleaved runs; "
            "speedup = median over rounds of the per-round FP32/INT8 median ratio (the machine is shared).",
            "int8 = the symmetric int8 Q/DQ graph (what TensorRT runs); ort_cpu_static = calibrated uint8 "
            "activations, ort_cpu_dynamic = int8 MatMul/Gemm weights with activation scales computed per batch "
            "(ONNX Runtime CPU graphs); **bold** = the one Kiln's ORT CPU engine loads "
            "(calibration.ort_cpu_scheme=auto). Accuracy on the digits held-out split.",
            "",
            "| row | params | variant | FP32 ms | INT8 ms | speedup | top-1 agree | acc FP32 | acc INT8 | Δ pts | "
            "kept FP32 | targets |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in results["rows"]:
            lat = r["latency"]
            for flavour, v in r["variants"].items():
                ok = ", ".join(f"{k}: {'yes' if t else 'NO'}" for k, t in v["targets_met"].items())
                shown = f"**{flavour}**" if v.get("kiln_ort_cpu_engine") else flavour
                lines.append(
                    f"| {r['row']} | {r['params'] or 'zoo default'} | {shown} | {lat['fp32']['p50_ms']:.3f} "
                    f"({lat['fp32']['p90_ms']:.3f}) | {lat[flavour]['p50_ms']:.3f} ({lat[flavour]['p90_ms']:.3f}) |"
                    f" {v['speedup']:.2f}x | {v['top1_agreement']:.4f} | {r['accuracy_fp32']:.4f} | "
                    f"{v['accuracy']:.4f} | {v['accuracy_delta_points']:+.2f} | {len(v['kept_fp32'])} | {ok} |"
                )
    else:
        lines += [
            "ORT CUDA (session.run with host arrays: copies included) vs PyTorch FP32, TF32 off.",
            "",
            "| model | samples | FP16 agree vs torch | FP16 cosine | FP32 agree | b1 FP32 / FP16 ms | "
            "b32 FP32 / FP16 ms | FP16 speedup b1 / b32 | kept FP32 | target |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in results["rows"]:
            f16, f32 = r["ort_fp16_vs_torch_fp32"], r["ort_fp32_vs_torch_fp32"]
            b1, b32 = r["latency_b1"], r["latency_b32"]
            lines.append(
                f"| {r['model']} | {r['samples']} | {f16['top1_agreement']:.4f} | {f16['cosine']:.6f} | "
                f"{f32['top1_agreement']:.4f} | {b1['ort_fp32']['p50_ms']:.2f} / {b1['ort_fp16']['p50_ms']:.2f}"
                f" | {b32['ort_fp32']['p50_ms']:.2f} / {b32['ort_fp16']['p50_ms']:.2f} | "
                f"{r['speedup_fp16_b1']:.2f}x / {r['speedup_fp16_b32']:.2f}x | {r['kept_fp32']} | "
                f"{'met' if all(r['targets_met'].values()) else 'NOT met'} |"
            )
    lines += ["", "Graphs: " + "; ".join(sorted({r["graph"] for r in results["rows"]}))]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--gpu", action="store_true", help="FP16 on ORT CUDA vs PyTorch FP32 (GPU host)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, CPU, seconds")
    ap.add_argument("--rows", default=",".join(CPU_ROWS), help="CPU rows to run")
    ap.add_argument("--epochs", type=int, default=None, help="training epochs (default: per row)")
    ap.add_argument("--method", default="minmax", choices=["minmax", "entropy", "percentile"])
    ap.add_argument("--samples", type=int, default=512)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(2 if not args.gpu else torch.get_num_threads())
    import onnxruntime as ort

    mode = ("gpu" if args.gpu else "cpu") + ("-smoke" if args.smoke else "")
    results: dict[str, Any] = {
        "mode": mode,
        "command": " ".join(sys.argv),
        "host": platform.node(),
        "onnxruntime": ort.__version__,
        "torch": torch.__version__,
        "cpu_int8_kernels": int8_kernels(),
        "rows": [],
    }
    with tempfile.TemporaryDirectory(prefix="kiln-pbench-") as tmp:
        work = Path(tmp)
        if args.gpu:
            for name, (params, shape) in gpu_specs(args.smoke).items():
                results["rows"].append(gpu_row(name, params, shape, args.smoke, work, args))
        else:
            rows = [r for r in args.rows.split(",") if r]
            for row in rows[:2] if args.smoke else rows:
                results["rows"].append(cpu_row(row, args.smoke, work, args))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"precision_{mode}"
    (args.out / f"{stem}.json").write_text(json.dumps(results, indent=2, default=str))
    md = markdown(results)
    (args.out / f"{stem}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
