"""Validate stage: every engine against the PyTorch model on held-out data, for accuracy and latency.

Accuracy: max abs error, cosine similarity, top-1 agreement, task accuracy. Latency: p50/p90/p99 after
warm-up at each configured batch size, with the PyTorch baseline measured in the same run. Gates decide
``passed``; the runner turns a failed gate into a non-zero exit.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import kiln.models
import kiln.models.model_io as model_io
import kiln.stages.engines
import kiln.stages.validate
import numpy as np
import torch
from kiln.core.compare import compare_arrays
from kiln.core.env import environment_subset
from kiln.core.inputs import check_batch_fits
from kiln.core.records import Baseline, EngineValidation, Percentiles, TensorSpec, ValidationResult
from kiln.core.stage import Stage, StageContext
from kiln.models.model_io import load_trained
from kiln.stages.engines.engines import engine_dirs, read_metadata
from kiln.stages.engines.registry import load_engine, runnable
from kiln.stages.precision import speed as precision_speed
from kiln.stages.precision.speed import drop_slower, speed_vs_fp32
from kiln.stages.validate.config import ValidateConfig
from kiln.stages.validate.report import report_section


def percentiles(times_ms: list[float]) -> Percentiles:
    p50, p90, p99 = np.percentile(np.asarray(times_ms), [50, 90, 99])
    return Percentiles(p50=float(p50), p90=float(p90), p99=float(p99))


def compare(ref: np.ndarray, got: np.ndarray, labels: np.ndarray | None) -> dict[str, float | None]:
    """The comparator's statistics of the logits output, plus task accuracy where there are labels."""
    stats = compare_arrays(ref, got)
    accuracy = float(np.mean(got.argmax(-1) == labels)) if labels is not None else None
    return {"max_abs_err": stats.max_abs_err, "cosine": stats.cosine, "top1_agreement": stats.top1_agreement,
            "accuracy": accuracy}


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


def gates_for(cfg: ValidateConfig, precision: str) -> dict[str, Any]:
    gates = cfg.gates.model_dump()
    gates.update(gates.pop("per_precision").get(precision, {}))
    return gates


def check_gates(entry: EngineValidation, baseline_acc: float | None, gates: dict[str, Any], largest: int) -> list[str]:
    """Each gate the engine misses, as a sentence naming the value and its threshold (NaN fails every gate)."""
    fails = []
    if not entry.cosine >= gates["min_cosine"]:
        fails.append(f"cosine {entry.cosine:.6f} < min_cosine {gates['min_cosine']}")
    if gates["max_abs_err"] is not None and not entry.max_abs_err <= gates["max_abs_err"]:
        fails.append(f"max_abs_err {entry.max_abs_err:.3g} > {gates['max_abs_err']}")
    if entry.top1_agreement is not None and not entry.top1_agreement >= gates["min_top1_agreement"]:
        fails.append(f"top1_agreement {entry.top1_agreement:.4f} < {gates['min_top1_agreement']}")
    if baseline_acc is not None and entry.accuracy is not None:
        drop = baseline_acc - entry.accuracy
        if not drop <= gates["max_accuracy_drop"]:
            fails.append(f"accuracy drop {drop:.4f} > max_accuracy_drop {gates['max_accuracy_drop']}")
    budget = gates["max_latency_p50_ms"]
    latency = entry.latency_ms.get(str(largest))
    if budget is not None and latency is not None and latency.p50 > budget:
        fails.append(f"p50 latency {latency.p50:.3f} ms at batch {largest} > {budget} ms")
    return fails


def validate_engine(engine_dir: Path, x: np.ndarray, y: np.ndarray, ref: np.ndarray, baseline: Baseline,
                    cfg: ValidateConfig, ctx: StageContext) -> EngineValidation:
    meta = read_metadata(engine_dir)
    entry = EngineValidation(name=meta.name, backend=meta.backend, precision=meta.precision, device=meta.device,
                             status="not-runnable")
    ok, why = runnable(meta)
    if not ok:
        entry.reason = why
        return entry
    largest = max(cfg.batch_sizes)
    with load_engine(engine_dir) as runner:
        name = runner.input_names[0]
        got = batched(lambda b: next(iter(runner.infer({name: b}).values())), x, largest)
        for key, value in compare(ref, got, y).items():
            setattr(entry, key, value)
        with ctx.progress.task(f"timing {meta.name}", total=len(cfg.batch_sizes)) as bar:
            for bs in cfg.batch_sizes:
                entry.latency_ms[str(bs)] = percentiles(runner.time_ms({name: sample_batch(x, bs)}, cfg.warmup,
                                                                      cfg.iterations))
                bar.advance()
    entry.speedup_vs_baseline = {bs: baseline.latency_ms[bs].p50 / lat.p50 for bs, lat in entry.latency_ms.items()}
    entry.gates = gates_for(cfg, meta.precision)
    entry.failures = check_gates(entry, baseline.accuracy, entry.gates, largest)
    entry.passed = not entry.failures
    entry.status = "validated"
    return entry


def run(ctx: StageContext) -> dict[str, Any]:
    cfg = ctx.config.validate_
    torch.manual_seed(ctx.config.seed)
    data = ctx.dataset()
    n = len(data.val_x) if cfg.max_samples is None else min(cfg.max_samples, len(data.val_x))
    xt, y = data.val_x[:n], data.val_y[:n].numpy()
    x = xt.numpy()
    check_batch_fits([TensorSpec(name="input", shape=["batch", *x.shape[1:]], dtype=x.dtype.name)], max(cfg.batch_sizes))
    model = load_trained(ctx.inputs["train"], ctx.config)
    with torch.inference_mode():
        ref = batched(lambda b: model(torch.from_numpy(b)).numpy(), x, max(cfg.batch_sizes))
    baseline = Baseline(accuracy=float(np.mean(ref.argmax(-1) == y)), samples=n, latency_ms={})
    with ctx.progress.task("timing PyTorch baseline", total=len(cfg.batch_sizes)) as bar:
        for bs in cfg.batch_sizes:
            xb = torch.from_numpy(sample_batch(x, bs))
            baseline.latency_ms[str(bs)] = percentiles(time_torch(model, xb, cfg.warmup, cfg.iterations))
            bar.advance()
    engines = [validate_engine(d, x, y, ref, baseline, cfg, ctx) for d in engine_dirs(ctx.inputs["build"])]
    validated = [e for e in engines if e.status == "validated"]
    failures = [f"{e.name}: {f}" for e in validated for f in e.failures]
    if not validated:
        failures.append("no engine could be validated on this machine")
    speed = speed_vs_fp32(engines)  # reduced precision that is not faster than FP32: flagged, or dropped
    dropped = drop_slower(engines, speed) if ctx.config.precision.require_speedup else []
    for row in speed:
        if row["slower"]:
            ctx.log.warning("%s is slower than FP32 at batch %s (%.2fx)%s", row["engine"], row["largest_batch"],
                            row["vs_fp32"][row["largest_batch"]], ": dropped" if row["engine"] in dropped else "")
    result = ValidationResult(passed=not failures, baseline=baseline, engines=engines, failures=failures,
                              speed_vs_fp32=speed, dropped=dropped)
    result.write(ctx.out / "validation.json")
    for e in engines:
        ctx.log.info("%s: %s", e.name, e.status)
    return result.model_dump(mode="json", exclude={"schema_version"})


def _env(cfg: Any) -> dict[str, Any]:
    return environment_subset("torch", "onnxruntime", "onnxruntime-gpu", "tensorrt", "tensorrt-rtx", device=True)


# Engines run through kiln.stages.engines' runners, and the baseline is built from kiln.models: their code is part
# of the result.
STAGE = Stage("validate", run, ("train", "build"), ("seed", "model", "data", "validate", "precision.require_speedup"),
              (kiln.stages.validate, kiln.stages.engines, kiln.models, model_io, precision_speed), _env,
              "accuracy and latency of every engine vs PyTorch, with gates", data=("dataset",), report=report_section)
