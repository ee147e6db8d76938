"""Validate stage: every engine against the PyTorch model on held-out data, for accuracy and latency.

Accuracy: max abs error, cosine similarity, top-1 agreement, task accuracy. Latency: p50/p90/p99 after
warm-up at each configured batch size, with the PyTorch baseline measured in the same run. Gates decide
``passed``; the runner turns a failed gate into a non-zero exit.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from kiln.core.stage import StageContext
from kiln.stages.engines.engines import SIDECAR, load_engine, read_metadata, runnable
from kiln.models.model_io import load_trained
from kiln.stages.precision.speed import drop_slower, speed_vs_fp32


def percentiles(times_ms: list[float]) -> dict[str, float]:
    p50, p90, p99 = np.percentile(np.asarray(times_ms), [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99)}


def compare(ref: np.ndarray, got: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    ref64, got64 = ref.astype(np.float64).ravel(), got.astype(np.float64).ravel()
    denom = np.linalg.norm(ref64) * np.linalg.norm(got64)
    return {
        "max_abs_err": float(np.max(np.abs(ref64 - got64))),
        "cosine": float(ref64 @ got64 / denom) if denom > 0 else float("nan"),
        "top1_agreement": float(np.mean(ref.argmax(-1) == got.argmax(-1))),
        "accuracy": float(np.mean(got.argmax(-1) == labels)),
    }


def batched(fn: Callable[[np.ndarray], np.ndarray], x: np.ndarray, batch: int) -> np.ndarray:
    return np.concatenate([fn(x[i:i + batch]) for i in range(0, len(x), batch)])


def time_torch(model: torch.nn.Module, x: torch.Tensor, warmup: int, iterations: int) -> list[float]:
    times = []
    with torch.inference_mode():
        for i in range(warmup + iterations):
            t0 = time.perf_counter()
            model(x)
            if i >= warmup:
                times.append((time.perf_counter() - t0) * 1e3)
    return times


def sample_batch(x: np.ndarray, batch: int) -> np.ndarray:
    reps = -(-batch // len(x))
    return np.concatenate([x] * reps)[:batch]


def gates_for(cfg: Any, precision: str) -> dict[str, Any]:
    gates = cfg.gates.model_dump()
    gates.update(gates.pop("per_precision").get(precision, {}))
    return gates


def check_gates(entry: dict[str, Any], baseline_acc: float, gates: dict[str, Any], largest: int) -> list[str]:
    fails = []
    if not entry["cosine"] >= gates["min_cosine"]:
        fails.append(f"cosine {entry['cosine']:.6f} < min_cosine {gates['min_cosine']}")
    if gates["max_abs_err"] is not None and not entry["max_abs_err"] <= gates["max_abs_err"]:
        fails.append(f"max_abs_err {entry['max_abs_err']:.3g} > {gates['max_abs_err']}")
    if not entry["top1_agreement"] >= gates["min_top1_agreement"]:
        fails.append(f"top1_agreement {entry['top1_agreement']:.4f} < {gates['min_top1_agreement']}")
    drop = baseline_acc - entry["accuracy"]
    if drop > gates["max_accuracy_drop"]:
        fails.append(f"accuracy drop {drop:.4f} > max_accuracy_drop {gates['max_accuracy_drop']}")
    budget = gates["max_latency_p50_ms"]
    if budget is not None and entry["latency_ms"][str(largest)]["p50"] > budget:
        fails.append(f"p50 latency {entry['latency_ms'][str(largest)]['p50']:.3f} ms at batch {largest} > {budget} ms")
    return fails


def validate_engine(engine_dir: Path, x: np.ndarray, y: np.ndarray, ref: np.ndarray, baseline: dict[str, Any],
                    cfg: Any, ctx: StageContext) -> dict[str, Any]:
    meta = read_metadata(engine_dir)
    entry: dict[str, Any] = {"name": meta["name"], "backend": meta["backend"], "precision": meta["precision"],
                             "device": meta.get("device")}
    ok, why = runnable(meta)
    if not ok:
        return {**entry, "passed": None, "status": "not-runnable", "reason": why}
    largest = max(cfg.batch_sizes)
    with load_engine(engine_dir) as runner:
        name = runner.input_names[0]
        got = batched(lambda b: next(iter(runner.infer({name: b}).values())), x, largest)
        entry.update(compare(ref, got, y))
        entry["latency_ms"] = {}
        with ctx.progress.task(f"timing {meta['name']}", total=len(cfg.batch_sizes)) as bar:
            for bs in cfg.batch_sizes:
                entry["latency_ms"][str(bs)] = percentiles(runner.time_ms({name: sample_batch(x, bs)}, cfg.warmup,
                                                                          cfg.iterations))
                bar.advance()
    entry["speedup_vs_baseline"] = {bs: baseline["latency_ms"][bs]["p50"] / lat["p50"]
                                    for bs, lat in entry["latency_ms"].items()}
    entry["failures"] = check_gates(entry, baseline["accuracy"], gates_for(cfg, meta["precision"]), largest)
    entry["passed"] = not entry["failures"]
    entry["status"] = "validated"
    return entry


def run(ctx: StageContext) -> dict[str, Any]:
    cfg = ctx.config.validate_
    torch.manual_seed(ctx.config.seed)
    data = ctx.dataset()
    n = len(data.val_x) if cfg.max_samples is None else min(cfg.max_samples, len(data.val_x))
    xt, y = data.val_x[:n], data.val_y[:n].numpy()
    x = xt.numpy()
    model = load_trained(ctx.inputs["train"], ctx.config)
    with torch.inference_mode():
        ref = batched(lambda b: model(torch.from_numpy(b)).numpy(), x, max(cfg.batch_sizes))
    baseline: dict[str, Any] = {"backend": "pytorch", "device": "cpu", "precision": "fp32",
                                "accuracy": float(np.mean(ref.argmax(-1) == y)), "samples": n, "latency_ms": {}}
    with ctx.progress.task("timing PyTorch baseline", total=len(cfg.batch_sizes)) as bar:
        for bs in cfg.batch_sizes:
            xb = torch.from_numpy(sample_batch(x, bs))
            baseline["latency_ms"][str(bs)] = percentiles(time_torch(model, xb, cfg.warmup, cfg.iterations))
            bar.advance()
    engines = [validate_engine(d, x, y, ref, baseline, cfg, ctx)
               for d in sorted(p.parent for p in ctx.inputs["build"].glob(f"*/{SIDECAR}"))]
    validated = [e for e in engines if e["status"] == "validated"]
    failures = [f"{e['name']}: {f}" for e in validated for f in e["failures"]]
    if not validated:
        failures.append("no engine could be validated on this machine")
    speed = speed_vs_fp32(engines)  # reduced precision that is not faster than FP32: flagged, or dropped
    dropped = drop_slower(engines, speed) if ctx.config.precision.require_speedup else []
    for row in speed:
        if row["slower"]:
            ctx.log.warning("%s is slower than FP32 at batch %s (%.2fx)%s", row["engine"], row["largest_batch"],
                            row["vs_fp32"][row["largest_batch"]], ": dropped" if row["engine"] in dropped else "")
    result = {"passed": not failures, "baseline": baseline, "engines": engines, "failures": failures,
              "speed_vs_fp32": speed, "dropped": dropped}
    (ctx.out / "validation.json").write_text(json.dumps(result, indent=2))
    for e in engines:
        ctx.log.info("%s: %s", e["name"], e.get("status"))
    return result
