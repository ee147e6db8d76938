"""Validate stage: every engine against the PyTorch model on held-out data, for accuracy and latency.

Accuracy: max abs error, cosine similarity, top-1 agreement, task accuracy. Latency: p50/p90/p99 after
warm-up at each configured batch size, with the PyTorch baseline measured in the same run. Gates decide
``passed``; the runner turns a failed gate into a non-zero exit.
"""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import kiln.models
import kiln.models.model_io as model_io
import kiln.stages.engines
import kiln.stages.validate
import numpy as np
import torch
from kiln.core.compare import OutputStats, compare_arrays, compare_outputs, worst
from kiln.core.data import (
    DatasetSplits,
    Feed,
    as_feed,
    call,
    feed_for_graph,
    feed_rows,
    feed_take,
    from_feed,
    input_names,
    rows,
    take,
)
from kiln.core.env import environment_subset
from kiln.core.errors import ModelError
from kiln.core.onnx_io import io_specs, load_onnx, ort_session
from kiln.core.outputs import logits_name, named_outputs
from kiln.core.records import Baseline, EngineValidation, Percentiles, ValidationResult
from kiln.core.shapes import axis_sizes, graph_axes, resize, shape_points
from kiln.core.stage import Stage, StageContext
from kiln.models.model_io import load_trained, torch_model_named
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
    """The comparator's statistics of one (logits) output, plus task accuracy where there are labels."""
    stats = compare_arrays(ref, got)
    accuracy = float(np.mean(got.argmax(-1) == labels)) if labels is not None else None
    return {"max_abs_err": stats.max_abs_err, "cosine": stats.cosine, "top1_agreement": stats.top1_agreement,
            "accuracy": accuracy}


def compare_all(ref: dict[str, np.ndarray], got: dict[str, np.ndarray], logits: str | None) -> dict[str, OutputStats]:
    """Every output of the reference against the candidate's output of the same name; top-1 agreement only on
    the class-logit output (on a hidden state it would be noise)."""
    missing = sorted(set(ref) - set(got))
    if missing:
        raise ModelError(f"the engine has no output {missing} (it has {sorted(got)})",
                         hint="rebuild the engines from this model's ONNX export (kiln run --force export)")
    stats = compare_outputs(ref, got)
    return {n: s if n == logits else replace(s, top1_agreement=None) for n, s in stats.items()}


def merge_worst(a: dict[str, OutputStats], b: dict[str, OutputStats]) -> dict[str, OutputStats]:
    """Per output, the worse value of each statistic (NaN is worst)."""
    def pick(x: float | None, y: float | None, higher: bool) -> float | None:
        if x is None or y is None:
            return y if x is None else x
        if np.isnan(x) or np.isnan(y):
            return float("nan")
        return min(x, y) if higher else max(x, y)
    out = dict(a)
    for name, s in b.items():
        if name in out:
            t = out[name]
            s = OutputStats(pick(t.max_abs_err, s.max_abs_err, False), pick(t.rel_err, s.rel_err, False),
                            pick(t.cosine, s.cosine, True), pick(t.top1_agreement, s.top1_agreement, True))
        out[name] = s
    return out


def summarize(entry: EngineValidation, stats: dict[str, OutputStats], logits: str | None) -> None:
    """The per-output statistics into the entry: the worst output carries the headline values the gates read."""
    entry.outputs = {n: s.as_dict() for n, s in stats.items()}
    entry.max_abs_err, entry.rel_err = worst(stats, "max_abs_err"), worst(stats, "rel_err")
    entry.cosine = worst(stats, "cosine")
    entry.top1_agreement = stats[logits].top1_agreement if logits in stats else None


def batched(fn: Callable[[Feed], dict[str, np.ndarray]], feed: Feed, batch: int) -> dict[str, np.ndarray]:
    """``fn`` over ``feed`` in batches of rows, outputs concatenated by name."""
    parts = [fn(feed_take(feed, slice(i, i + batch))) for i in range(0, feed_rows(feed), batch)]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def time_call(fn: Callable[[], Any], warmup: int, iterations: int) -> list[float]:
    times = []
    with torch.inference_mode():
        for i in range(warmup + iterations):
            t0 = time.perf_counter()
            fn()
            if i >= warmup:
                times.append((time.perf_counter() - t0) * 1e3)
    return times


def sample_batch(x: Any, batch: int) -> Any:
    """``batch`` rows of ``x`` (an array or a feed), repeating its rows when it has fewer."""
    if isinstance(x, dict):
        return {k: sample_batch(v, batch) for k, v in x.items()}
    reps = -(-batch // len(x))
    return np.concatenate([x] * reps)[:batch]


def gates_for(cfg: ValidateConfig, precision: str) -> dict[str, Any]:
    gates = cfg.gates.model_dump()
    gates.update(gates.pop("per_precision").get(precision, {}))
    return gates


def check_gates(entry: EngineValidation, baseline_acc: float | None, gates: dict[str, Any], largest: int) -> list[str]:
    """Each gate the engine misses, as a sentence naming the value and its threshold (NaN fails every gate)."""
    fails = []
    # Per output: the worst one must pass (named when the model has several)
    per_output = entry.outputs if len(entry.outputs) > 1 else {"": {"cosine": entry.cosine,
                                                                      "max_abs_err": entry.max_abs_err}}
    for name, s in per_output.items():
        where = f"output '{name}' " if name else ""
        if not s["cosine"] >= gates["min_cosine"]:
            fails.append(f"{where}cosine {s['cosine']:.6f} < min_cosine {gates['min_cosine']}")
        if gates["max_abs_err"] is not None and not s["max_abs_err"] <= gates["max_abs_err"]:
            fails.append(f"{where}max_abs_err {s['max_abs_err']:.3g} > {gates['max_abs_err']}")
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


class Reference:
    """What the engines are compared with: the PyTorch model (or, started from an ONNX file, the FP32 ONNX in
    ONNX Runtime) on the held-out inputs at every validated shape, with its labels where there are any."""

    def __init__(self, run: Callable[[Feed], dict[str, np.ndarray]], feeds: list[tuple[dict[str, int], Feed]],
                 labels: np.ndarray | None, logits: str | None, batch: int) -> None:
        self.run, self.feeds, self.labels, self.logits = run, feeds, labels, logits
        self.outputs = [batched(run, feed, batch) for _, feed in feeds]  # the largest batch, every shape

    @property
    def feed(self) -> Feed:
        """The inputs at the data's own shape (the last point: the largest sizes), for accuracy and latency."""
        return self.feeds[-1][1]


def validate_engine(engine_dir: Path, ref: Reference, baseline: Baseline, cfg: ValidateConfig,
                    ctx: StageContext) -> EngineValidation:
    meta = read_metadata(engine_dir)
    entry = EngineValidation(name=meta.name, backend=meta.backend, precision=meta.precision, device=meta.device,
                             status="not-runnable")
    ok, why = runnable(meta)
    if not ok:
        entry.reason = why
        return entry
    largest = max(cfg.batch_sizes)
    with load_engine(engine_dir) as runner:
        stats: dict[str, OutputStats] = {}
        for (point, feed), expected in zip(ref.feeds, ref.outputs):
            got = batched(runner.infer, feed, largest)
            stats = merge_worst(stats, compare_all(expected, got, ref.logits))
            for bs in cfg.batch_sizes:  # every batch size at every shape: one batch each
                rows_ = {k: sample_batch(v, bs) for k, v in expected.items()}
                stats = merge_worst(stats, compare_all(rows_, runner.infer(sample_batch(feed, bs)), ref.logits))
            if point is ref.feeds[-1][0] and ref.logits is not None and ref.labels is not None:
                entry.accuracy = float(np.mean(got[ref.logits].argmax(-1) == ref.labels))
        summarize(entry, stats, ref.logits)
        entry.shapes = [p for p, _ in ref.feeds if p]
        with ctx.progress.task(f"timing {meta.name}", total=len(cfg.batch_sizes)) as bar:
            for bs in cfg.batch_sizes:
                entry.latency_ms[str(bs)] = percentiles(runner.time_ms(sample_batch(ref.feed, bs), cfg.warmup,
                                                                      cfg.iterations))
                bar.advance()
    entry.speedup_vs_baseline = {bs: baseline.latency_ms[bs].p50 / lat.p50 for bs, lat in entry.latency_ms.items()}
    entry.failures = check_gates(entry, baseline.accuracy, gates_for(cfg, meta.precision), largest)
    entry.passed = not entry.failures
    entry.status = "validated"
    return entry


def torch_reference(ctx: StageContext, data: DatasetSplits, cfg: ValidateConfig) -> tuple[Reference, Callable[[Feed], Any]]:
    """The trained PyTorch model as the reference; also a timing call on a feed."""
    model = load_trained(ctx.inputs["train"], ctx.config)
    names = input_names(model, data.val_x)
    n = rows(data.val_x) if cfg.max_samples is None else min(cfg.max_samples, rows(data.val_x))
    feed = as_feed(take(data.val_x, slice(0, n)), names)
    axes = ctx.config.export.dynamic_axes
    sizes = axis_sizes([as_feed(data.train_x, names), feed] if rows(data.train_x) else [feed], axes, cfg.shapes)
    feeds = [(p, resize(feed, axes, p)) for p in shape_points(sizes)]

    def run(f: Feed) -> dict[str, np.ndarray]:
        with torch.inference_mode():
            return {k: v.float().numpy() for k, v in named_outputs(model, from_feed(f, data.val_x)).items()}

    def timed(f: Feed) -> Any:
        return lambda: call(model, from_feed(f, data.val_x))

    with torch.inference_mode():
        out_names = list(named_outputs(model, from_feed(feed_take(feed, slice(0, 2)), data.val_x)))
    logits = logits_name(out_names, cfg.logits_output)
    labels = data.val_y[:n].numpy() if data.val_y is not None and data.classification else None
    return Reference(run, feeds, labels, logits, max(cfg.batch_sizes)), timed


def onnx_reference(ctx: StageContext, data: DatasetSplits, cfg: ValidateConfig) -> tuple[Reference, Callable[[Feed], Any]]:
    """Started from ``model.onnx`` with no PyTorch model: the FP32 ONNX file in ONNX Runtime (CPU) is the reference."""
    path = Path(ctx.config.model.onnx)
    sess = ort_session(path)
    inputs, outputs = io_specs(load_onnx(path, load_external_data=False))
    names = [i.name for i in inputs]
    n = rows(data.val_x) if cfg.max_samples is None else min(cfg.max_samples, rows(data.val_x))
    feed = feed_for_graph(take(data.val_x, slice(0, n)), names, f"model.onnx {path.name}")
    axes = ctx.config.export.dynamic_axes or graph_axes(inputs)
    train = [feed_for_graph(data.train_x, names)] if rows(data.train_x) else []
    feeds = [(p, resize(feed, axes, p)) for p in shape_points(axis_sizes(train + [feed], axes, cfg.shapes))]
    out_names = [o.name for o in outputs]

    def run(f: Feed) -> dict[str, np.ndarray]:
        return dict(zip(out_names, sess.run(None, f)))

    labels = data.val_y[:n].numpy() if data.val_y is not None and data.classification else None
    return (Reference(run, feeds, labels, logits_name(out_names, cfg.logits_output), max(cfg.batch_sizes)),
            lambda f: lambda: sess.run(None, f))


def run(ctx: StageContext) -> dict[str, Any]:
    cfg = ctx.config.validate_
    torch.manual_seed(ctx.config.seed)
    data = ctx.dataset()
    if torch_model_named(ctx.config):
        ref, timed = torch_reference(ctx, data, cfg)
    else:
        ref, timed = onnx_reference(ctx, data, cfg)
    accuracy = None
    if ref.logits is not None and ref.labels is not None:
        accuracy = float(np.mean(ref.outputs[-1][ref.logits].argmax(-1) == ref.labels))
    backend = "pytorch" if torch_model_named(ctx.config) else "onnxruntime"
    baseline = Baseline(backend=backend, accuracy=accuracy, samples=feed_rows(ref.feed), latency_ms={},
                        logits_output=ref.logits,
                        compared=list(ref.outputs[-1]), shapes=[p for p, _ in ref.feeds if p])
    if ref.logits is None:
        ctx.log.info("no class-logit output among %s: engines compared by error and cosine per output, without "
                     "top-1 agreement or accuracy (set validate.logits_output to name one)", baseline.compared)
    with ctx.progress.task("timing PyTorch baseline", total=len(cfg.batch_sizes)) as bar:
        for bs in cfg.batch_sizes:
            baseline.latency_ms[str(bs)] = percentiles(time_call(timed(sample_batch(ref.feed, bs)), cfg.warmup,
                                                                 cfg.iterations))
            bar.advance()
    return finish(ctx, [validate_engine(d, ref, baseline, cfg, ctx) for d in engine_dirs(ctx.inputs["build"])],
                  baseline)


def finish(ctx: StageContext, engines: list[EngineValidation], baseline: Baseline) -> dict[str, Any]:
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
STAGE = Stage("validate", run, ("train", "build"), ("seed", "model", "data", "validate", "precision.require_speedup",
                                                  "export.dynamic_axes"),
              (kiln.stages.validate, kiln.stages.engines, kiln.models, model_io, precision_speed), _env,
              "accuracy and latency of every engine vs PyTorch, with gates", data=("dataset", "onnx"), report=report_section)
