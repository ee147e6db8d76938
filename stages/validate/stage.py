"""Validate stage: every engine against the PyTorch model on held-out data, for accuracy and latency.

Accuracy: max abs error, cosine similarity, top-1 agreement, task accuracy. Latency: p50/p90/p99 after
warm-up at each configured batch size, with the PyTorch baseline measured in the same run. Gates decide
``passed``; the runner turns a failed gate into a non-zero exit.
"""
from __future__ import annotations

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
from kiln.core.records import Baseline, EngineValidation, Memory, TensorSpec, ValidationResult
from kiln.core.stage import Stage, StageContext
from kiln.models.model_io import load_trained
from kiln.stages.engines.engines import engine_dirs, read_metadata
from kiln.stages.engines.registry import load_engine, preference_order, runnable
from kiln.stages.precision import speed as precision_speed
from kiln.stages.precision.speed import drop_slower, speed_vs_fp32
from kiln.stages.validate.baselines import measure, percentiles, speedups
from kiln.stages.validate.config import ValidateConfig
from kiln.stages.validate.memory import PeakMemory, wait_a_sample
from kiln.stages.validate.report import report_section


def compare(ref: np.ndarray, got: np.ndarray, labels: np.ndarray | None) -> dict[str, float | None]:
    """The comparator's statistics of the logits output, plus task accuracy where there are labels."""
    stats = compare_arrays(ref, got)
    accuracy = float(np.mean(got.argmax(-1) == labels)) if labels is not None else None
    return {"max_abs_err": stats.max_abs_err, "cosine": stats.cosine, "top1_agreement": stats.top1_agreement,
            "accuracy": accuracy}


def batched(fn: Callable[[np.ndarray], np.ndarray], x: np.ndarray, batch: int) -> np.ndarray:
    return np.concatenate([fn(x[i:i + batch]) for i in range(0, len(x), batch)])


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


def validate_engine(engine_dir: Path, x: np.ndarray, y: np.ndarray, ref: np.ndarray, baselines: list[Baseline],
                    cfg: ValidateConfig, ctx: StageContext) -> EngineValidation:
    meta = read_metadata(engine_dir)
    entry = EngineValidation(name=meta.name, backend=meta.backend, precision=meta.precision, device=meta.device,
                             status="not-runnable")
    ok, why = runnable(meta)
    if not ok:
        entry.reason = why
        return entry
    largest = max(cfg.batch_sizes)
    runner = load_engine(engine_dir)  # loads nothing yet: activate() does, inside the memory meter
    try:
        name = runner.input_names[0]
        with PeakMemory(meta.device) as mem:  # loading + the accuracy pass at the largest batch
            runner.activate()
            got = batched(lambda b: next(iter(runner.infer({name: b}).values())), x, largest)
            wait_a_sample()
        entry.memory = Memory(peak_mb=mem.peak_mb, method=mem.method, size_bytes=meta.size_bytes)
        for key, value in compare(ref, got, y).items():
            setattr(entry, key, value)
        with ctx.progress.task(f"timing {meta.name}", total=len(cfg.batch_sizes)) as bar:
            for bs in cfg.batch_sizes:
                entry.latency_ms[str(bs)] = percentiles(runner.time_ms({name: sample_batch(x, bs)}, cfg.warmup,
                                                                      cfg.iterations))
                bar.advance()
    finally:
        runner.deactivate()
    entry.speedups = speedups(meta.device, entry.latency_ms, baselines)
    entry.speedup_vs_baseline = entry.speedups.get(f"eager-{meta.device}", {})
    entry.gates = gates_for(cfg, meta.precision)
    entry.failures = check_gates(entry, baselines[0].accuracy if baselines else None, entry.gates, largest)
    entry.passed = not entry.failures
    entry.status = "validated"
    return entry


def measure_baselines(model: torch.nn.Module, devices: list[str], x: np.ndarray, n: int, cfg: ValidateConfig,
                      ctx: StageContext) -> list[Baseline]:
    """Every configured baseline kind on every device an engine runs on (the CPU always: it is the accuracy
    reference's device)."""
    batches = {bs: sample_batch(x, bs) for bs in cfg.batch_sizes}
    runs = [(kind, device, precision) for device in devices for kind in cfg.baselines
            for precision in (cfg.baseline_precisions if device == "cuda" else ["fp32"])]
    out = []
    with ctx.progress.task("timing PyTorch baselines", total=len(runs)) as bar:
        for kind, device, precision in runs:
            b = measure(model, kind, device, precision, batches, cfg.warmup, cfg.iterations, n)
            if b.error:
                ctx.log.warning("PyTorch baseline %s not measured: %s", b.label, b.error)
            out.append(b)
            bar.advance()
    return out


def choose(engines: list[EngineValidation], order: list[str], margin: float) -> dict[str, str]:
    """Per batch size, the fastest engine that passed its gates (and was not dropped). Engines are considered in
    ``order`` (backend preference: TensorRT first); a later one takes the choice only when faster than the current
    choice by more than ``margin``."""
    rank = {b: i for i, b in enumerate(order)}
    ok = sorted((e for e in engines if e.status == "validated" and e.passed and not e.dropped),
                key=lambda e: (rank.get(e.backend, len(rank)), e.name))
    chosen: dict[str, str] = {}
    for bs in sorted({bs for e in ok for bs in e.latency_ms}, key=int):
        best: EngineValidation | None = None
        for e in (e for e in ok if bs in e.latency_ms):
            if best is None or e.latency_ms[bs].p50 < best.latency_ms[bs].p50 * (1 - margin):
                best = e
        if best is not None:
            chosen[bs] = best.name
    return chosen


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
    accuracy = float(np.mean(ref.argmax(-1) == y))
    dirs = engine_dirs(ctx.inputs["build"])
    metas = [read_metadata(d) for d in dirs]
    devices = sorted({"cpu"} | {m.device for m in metas if runnable(m)[0]})
    baselines = measure_baselines(model, devices, x, n, cfg, ctx)
    for b in baselines:
        b.accuracy = accuracy  # the same weights in FP32 (eager or compiled): the CPU reference's accuracy
    baseline = next(b for b in baselines if b.device == "cpu" and b.kind == cfg.baselines[0])
    if baseline.error:  # the accuracy reference must have numbers: eager on the CPU
        baseline = Baseline(accuracy=accuracy, samples=n, latency_ms={}, error=baseline.error)
    engines = [validate_engine(d, x, y, ref, baselines, cfg, ctx) for d in dirs]
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
    chosen = choose(engines, preference_order(), cfg.choice_margin)
    result = ValidationResult(passed=not failures, baseline=baseline, baselines=baselines, engines=engines,
                              failures=failures, speed_vs_fp32=speed, dropped=dropped, chosen=chosen)
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
