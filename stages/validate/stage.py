"""Validate stage: every engine against the PyTorch model on held-out data, for accuracy and latency.

Accuracy: max abs error, cosine similarity, top-1 agreement, task accuracy. Latency: p50/p90/p99 after
warm-up at each configured batch size, with the PyTorch baseline measured in the same run. Gates decide
``passed``; the runner turns a failed gate into a non-zero exit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

import kiln.models
import kiln.models.model_io as model_io
import kiln.stages.engines
import kiln.stages.validate
from kiln.core.compare import OutputStats, compare_arrays, compare_outputs, worst
from kiln.core.data import (
    DatasetSplits,
    Feed,
    as_feed,
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
from kiln.core.inputs import check_batch_fits
from kiln.core.labels import IGNORE_LABEL, per_position
from kiln.core.labels import accuracy as label_accuracy
from kiln.core.onnx_io import io_specs, load_onnx, ort_session
from kiln.core.outputs import logits_name, named_outputs
from kiln.core.records import Baseline, EngineMetadata, EngineValidation, Memory, TensorSpec, ValidationResult
from kiln.core.shapes import Axes, axis_sizes, graph_axes, resize, shape_points
from kiln.core.signature import Signature
from kiln.core.stage import Stage, StageContext, StageSettings
from kiln.core.timing import time_calls
from kiln.models.config import DataConfig, ModelConfig
from kiln.models.model_io import load_trained, torch_model_named
from kiln.stages.engines.backend import engine_dirs, read_metadata
from kiln.stages.engines.registry import backend_libraries, backend_named, load_engine, preference_order, runnable
from kiln.stages.precision import speed as precision_speed
from kiln.stages.precision.speed import drop_slower, speed_vs_fp32
from kiln.stages.validate.baselines import measure, percentiles, speedups
from kiln.stages.validate.config import ValidateConfig
from kiln.stages.validate.memory import PeakMemory, wait_a_sample
from kiln.stages.validate.report import report_section

log = logging.getLogger("kiln.validate")


def compare(ref: np.ndarray, got: np.ndarray, labels: np.ndarray | None) -> dict[str, float | None]:
    """The comparator's statistics of the logits output, plus task accuracy where there are labels."""
    stats = compare_arrays(ref, got)
    accuracy = label_accuracy(got, labels) if labels is not None else None
    return {
        "max_abs_err": stats.max_abs_err,
        "cosine": stats.cosine,
        "top1_agreement": stats.top1_agreement,
        "accuracy": accuracy,
    }


def compare_all(
    ref: dict[str, np.ndarray], got: dict[str, np.ndarray], logits: str | None, where: np.ndarray | None = None
) -> dict[str, OutputStats]:
    """Every output of the reference against the candidate's output of the same name; top-1 agreement only on
    the class-logit output (on a hidden state it would be noise), and with per-position labels only over the
    labelled positions (``where``: a token classifier's padding carries no label and no answer anyone reads)."""
    missing = sorted(set(ref) - set(got))
    if missing:
        raise ModelError(
            f"the engine has no output {missing} (it has {sorted(got)})",
            hint="rebuild the engines from this model's ONNX export (kiln run --force export)",
        )
    try:
        stats = compare_outputs(ref, got, where={logits: where} if logits is not None and where is not None else None)
    except ValueError as exc:  # an output of another shape than the reference's at the same inputs
        raise ModelError(
            f"the engine's outputs do not match the reference's: {exc}",
            hint="rebuild the engines from this model's ONNX export (kiln run --force export)",
        ) from None
    return {n: s if n == logits else replace(s, top1_agreement=None, top1_ties=None) for n, s in stats.items()}


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
            s = OutputStats(
                pick(t.max_abs_err, s.max_abs_err, False),
                pick(t.rel_err, s.rel_err, False),
                pick(t.cosine, s.cosine, True),
                pick(t.top1_agreement, s.top1_agreement, True),
                pick(t.top1_ties, s.top1_ties, False),
            )
        out[name] = s
    return out


def summarize(entry: EngineValidation, stats: dict[str, OutputStats], logits: str | None) -> None:
    """The per-output statistics into the entry: the worst output carries the headline values the gates read."""
    entry.outputs = {n: s.as_dict() for n, s in stats.items()}
    entry.max_abs_err, entry.rel_err = worst(stats, "max_abs_err"), worst(stats, "rel_err")
    entry.cosine = worst(stats, "cosine")
    entry.top1_agreement = stats[logits].top1_agreement if logits in stats else None
    entry.top1_ties = stats[logits].top1_ties if logits in stats else None


def batch_coupled(run: Callable[[Feed], dict[str, np.ndarray]], feed: Feed, batch: int, smallest: int) -> list[str]:
    """Outputs whose shape beyond the first axis follows the batch size (a contrastive model's ``[images, texts]``
    logits): their rows depend on the whole batch, so they compare only between calls on the same batch. Probed at
    the largest validated batch against the smallest (or, with one size, the last, shorter batch of the held-out
    rows), sizes the model is validated at anyway; a model that fails the probe is left to the comparisons to
    report."""
    other = smallest if smallest != batch else feed_rows(feed) % batch
    if not other or feed_rows(feed) < 2:
        return []
    try:
        big, small = run(sample_batch(feed, batch)), run(sample_batch(feed, other))
    except Exception:  # the reference's own error surfaces where the comparisons run it
        return []
    return [k for k in big if k in small and big[k].shape[1:] != small[k].shape[1:]]


def batched(fn: Callable[[Feed], dict[str, np.ndarray]], feed: Feed, batch: int) -> dict[str, np.ndarray]:
    """``fn`` over ``feed`` in batches of rows, outputs concatenated by name."""
    parts = [fn(feed_take(feed, slice(i, i + batch))) for i in range(0, feed_rows(feed), batch)]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def sample_batch(x: Any, batch: int) -> Any:
    """``batch`` rows of ``x`` (an array or a feed), repeating its rows when it has fewer."""
    if isinstance(x, dict):
        return {k: sample_batch(v, batch) for k, v in x.items()}
    reps = -(-batch // len(x))
    return np.concatenate([x] * reps)[:batch]


LATENCY_GATE = "p50 latency"  # how the one gate that is not about accuracy starts


def engine_hints(meta: EngineMetadata, failures: list[str]) -> list[str]:
    """What to try when an engine missed accuracy gates: its backend's hints (the way it was built may explain)."""
    accuracy = [f for f in failures if not f.startswith(LATENCY_GATE)]
    return backend_named(meta.backend).hints(meta, accuracy) if accuracy else []


def gates_for(cfg: ValidateConfig, precision: str) -> dict[str, Any]:
    gates = cfg.gates.model_dump()
    gates.update(gates.pop("per_precision").get(precision, {}))
    return gates


def check_gates(entry: EngineValidation, baseline_acc: float | None, gates: dict[str, Any], largest: int) -> list[str]:
    """Each gate the engine misses, as a sentence naming the value and its threshold (NaN fails every gate)."""
    fails = []
    # Per output: the worst one must pass (named when the model has several)
    per_output = (
        entry.outputs if len(entry.outputs) > 1 else {"": {"cosine": entry.cosine, "max_abs_err": entry.max_abs_err}}
    )
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
        fails.append(f"{LATENCY_GATE} {latency.p50:.3f} ms at batch {largest} > {budget} ms")
    return fails


def labels_at_points(
    labels: np.ndarray | None, feed: Feed, feeds: list[tuple[dict[str, int], Feed]], axes: Axes
) -> list[np.ndarray | None]:
    """The held-out labels at each validated shape: labels per row as they are; labels per position follow the input
    they are shaped like (a token classifier's ``[N, seq]`` tags follow ``input_ids``: cut, or padded with
    ``IGNORE_LABEL`` where the input is padded with zeros). None at a shape they cannot follow."""
    if labels is None or not per_position(labels):
        return [labels] * len(feeds)
    like = next((k for k, v in feed.items() if v.shape == labels.shape), None)
    out: list[np.ndarray | None] = []
    for point, resized in feeds:
        if like is not None:
            out.append(resize({like: labels}, {like: axes.get(like) or {}}, point, fill=IGNORE_LABEL)[like])
        else:  # e.g. pixel labels [N, H, W] of images [N, 3, H, W]: only at the data's own shape
            out.append(labels if all(resized[k].shape == v.shape for k, v in feed.items()) else None)
    return out


class Reference:
    """What the engines are compared with: the PyTorch model (or, started from an ONNX file, the FP32 ONNX in
    ONNX Runtime) on the held-out inputs at every validated shape, with its labels where there are any (one array
    per shape: :func:`labels_at_points`)."""

    def __init__(
        self,
        run: Callable[[Feed], dict[str, np.ndarray]],
        feeds: list[tuple[dict[str, int], Feed]],
        labels: list[np.ndarray | None],
        logits: str | None,
        batch: int,
        smallest: int = 1,
    ) -> None:
        self.run, self.feeds, self.point_labels, self.logits = run, feeds, labels, logits
        self.coupled = coupled = batch_coupled(run, feeds[0][1], batch, smallest)
        if coupled:  # compare whole batches only: a last, shorter batch gives those outputs another shape
            rows = feed_rows(feeds[0][1]) // batch * batch
            if not rows:
                raise ModelError(
                    f"the outputs {coupled} follow the batch beyond their first axis (each row depends "
                    f"on the whole batch), and the data has fewer held-out rows than the largest "
                    f"validated batch ({batch})",
                    hint="give the data more held-out rows, or validate smaller signature.batch_sizes",
                )
            log.info(
                "outputs %s depend on the whole batch: compared on %d held-out rows (whole batches of %d)",
                coupled,
                rows,
                batch,
            )
            self.feeds = [(point, feed_take(feed, slice(0, rows))) for point, feed in feeds]
            self.point_labels = [None if y is None else y[:rows] for y in labels]
        self.outputs = [batched(run, feed, batch) for _, feed in self.feeds]  # the largest batch, every shape
        self._at: dict[tuple[int, int], dict[str, np.ndarray]] = {}

    def at_batch(self, index: int, batch: int) -> dict[str, np.ndarray]:
        """The reference on ``batch`` rows of feed ``index`` (:func:`sample_batch`): what an engine called at that
        batch size is compared with. Rows of the largest batch's outputs; where an output mixes the batch's rows
        (CLIP's image-text logits, ``[images, texts]``: :attr:`coupled`), the reference run at that batch size."""
        if not self.coupled:
            return {k: sample_batch(v, batch) for k, v in self.outputs[index].items()}
        if (index, batch) not in self._at:
            self._at[(index, batch)] = self.run(sample_batch(self.feeds[index][1], batch))
        return self._at[(index, batch)]

    @property
    def feed(self) -> Feed:
        """The inputs at the data's own shape (the last point: the largest sizes), for accuracy and latency."""
        return self.feeds[-1][1]

    @property
    def labels(self) -> np.ndarray | None:
        """The labels of :attr:`feed`, for accuracy."""
        return self.point_labels[-1]

    def labelled(self, index: int, batch: int | None = None) -> np.ndarray | None:
        """Where feed ``index`` (``batch`` rows of it: :func:`sample_batch`) has per-position labels, the labelled
        positions, over which top-1 agreement is counted; None: every row and position counts."""
        y = self.point_labels[index]
        if y is None or not per_position(y):
            return None
        return (y if batch is None else sample_batch(y, batch)) != IGNORE_LABEL


def validate_engine(
    engine_dir: Path,
    ref: Reference,
    baselines: list[Baseline],
    cfg: ValidateConfig,
    ctx: StageContext[ValidateSettings],
) -> EngineValidation:
    meta = read_metadata(engine_dir)
    entry = EngineValidation(
        name=meta.name, backend=meta.backend, precision=meta.precision, device=meta.device, status="not-runnable"
    )
    ok, why = runnable(meta)
    if not ok:
        entry.reason = why
        return entry
    largest = max(ctx.config.signature.batch_sizes)
    runner = load_engine(engine_dir)  # loads nothing yet: activate() does, inside the memory meter
    shape_problems: list[str] = []
    untaken: list[dict[str, int]] = []
    try:
        stats: dict[str, OutputStats] = {}
        for i, ((point, feed), expected) in enumerate(zip(ref.feeds, ref.outputs)):
            if not takes_shape(meta, feed):  # an axis the engine takes at one size only (recorded at its build)
                untaken.append(point)
                continue
            if not runner.active:
                with PeakMemory(meta.device) as mem:  # loading + the accuracy pass at the largest batch
                    runner.activate()
                    got = batched(runner.infer, feed, largest)
                    wait_a_sample()
                entry.memory = Memory(peak_mb=mem.peak_mb, method=mem.method, size_bytes=meta.size_bytes)
            else:
                got = batched(runner.infer, feed, largest)
            stats = merge_worst(stats, compare_all(expected, got, ref.logits, ref.labelled(i)))
            for bs in ctx.config.signature.batch_sizes:  # every batch size at every shape: one batch each
                feed_bs = sample_batch(feed, bs)
                got_bs = runner.infer(feed_bs)
                problems = declared_shape_problems(meta, feed_bs, got_bs)  # one call's arrays, as a server gets them
                shape_problems += [p for p in problems if p not in shape_problems]
                stats = merge_worst(stats, compare_all(ref.at_batch(i, bs), got_bs, ref.logits, ref.labelled(i, bs)))
            if i == len(ref.feeds) - 1 and ref.logits is not None and ref.labels is not None:
                entry.accuracy = label_accuracy(got[ref.logits], ref.labels)
        if not runner.active:
            shape_problems.append(f"takes none of the validated shapes {[p for p, _ in ref.feeds]}")
        else:
            summarize(entry, stats, ref.logits)
            entry.shapes = [p for p, _ in ref.feeds if p and p not in untaken]
            with ctx.progress.task(f"timing {meta.name}", total=len(ctx.config.signature.batch_sizes)) as bar:
                for bs in ctx.config.signature.batch_sizes:
                    entry.latency_ms[str(bs)] = percentiles(
                        runner.time_ms(sample_batch(ref.feed, bs), cfg.warmup, cfg.iterations, cfg.time_budget_s)
                    )
                    bar.advance()
    finally:
        runner.deactivate()
    entry.speedups = speedups(meta.device, entry.latency_ms, baselines)
    entry.speedup_vs_baseline = entry.speedups.get(f"eager-{meta.device}", {})
    entry.gates = gates_for(cfg, meta.precision)
    entry.failures = check_gates(entry, baselines[0].accuracy if baselines else None, entry.gates, largest)
    entry.failures += shape_problems
    entry.passed = not entry.failures
    entry.hints = engine_hints(meta, entry.failures)
    if untaken:
        fixed = [f"{s.name} {list(s.shape)}" for s in meta.inputs]
        entry.hints.append(f"takes one size on some axes ({', '.join(fixed)}): not validated at {untaken}")
    entry.status = "validated"
    return entry


def takes_shape(meta: EngineMetadata, feed: dict[str, np.ndarray]) -> bool:
    """Whether the engine's declared inputs take ``feed``'s shapes beyond the batch axis."""
    for spec in meta.inputs:
        shape = np.shape(feed.get(spec.name))
        for axis, dim in enumerate(spec.shape):
            if axis and isinstance(dim, int) and dim > 0 and axis < len(shape) and shape[axis] != dim:
                return False
    return True


def declared_shape_problems(meta: EngineMetadata, feed: dict[str, np.ndarray], got: dict[str, np.ndarray]) -> list[str]:
    """Where an output's array disagrees with the shape the engine declares (what serving and Triton hold it to):
    a fixed axis of another size, or a named axis whose size is not the inputs' axis of that name."""
    seen: dict[str, set[int]] = {}
    for spec in meta.inputs:
        for axis, dim in enumerate(spec.shape):
            if isinstance(dim, str) and spec.name in feed and axis < feed[spec.name].ndim:
                seen.setdefault(dim, set()).add(feed[spec.name].shape[axis])
    # a name the inputs give one size (inputs that disagree, as a CLIP's images and texts, hold it to nothing)
    sizes = {dim: next(iter(v)) for dim, v in seen.items() if len(v) == 1}
    problems = []
    for spec in meta.outputs:
        if spec.name not in got or not spec.shape:
            continue
        shape = np.shape(got[spec.name])
        ok = len(shape) == len(spec.shape) and all(
            have == want if isinstance(want, int) and want > 0 else sizes.get(str(want), have) == have  # 0: unknown
            for have, want in zip(shape, spec.shape)
        )
        if not ok:
            problems.append(f"output '{spec.name}' is declared {list(spec.shape)}, the engine returned {list(shape)}")
    return problems


def baseline_devices(engine_devices: set[str], cpu: str) -> list[str]:
    """Where PyTorch is timed: each device an engine runs on, and the CPU where ``validate.cpu_baseline`` asks for it
    (auto: when an engine runs there, or none runs anywhere)."""
    wants_cpu = cpu == "on" or (cpu == "auto" and ("cpu" in engine_devices or not engine_devices))
    return sorted((engine_devices - {"cpu"}) | ({"cpu"} if wants_cpu else set()))


def measure_baselines(
    model: torch.nn.Module,
    devices: list[str],
    feed: Feed,
    like: Any,
    n: int,
    cfg: ValidateConfig,
    ctx: StageContext[ValidateSettings],
) -> list[Baseline]:
    """Every configured baseline kind on every device in ``devices``, on ``feed`` (named inputs, called in ``like``'s
    structure)."""
    batches = {bs: sample_batch(feed, bs) for bs in ctx.config.signature.batch_sizes}
    runs = [
        (kind, device, precision)
        for device in devices
        for kind in cfg.baselines
        for precision in (cfg.baseline_precisions if device == "cuda" else ["fp32"])
    ]
    out = []
    with ctx.progress.task("timing PyTorch baselines", total=len(runs)) as bar:
        for kind, device, precision in runs:
            b = measure(model, kind, device, precision, batches, cfg.warmup, cfg.iterations, n, like, cfg.time_budget_s)
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
    ok = sorted(
        (e for e in engines if e.status == "validated" and e.passed and not e.dropped),
        key=lambda e: (rank.get(e.backend, len(rank)), e.name),
    )
    chosen: dict[str, str] = {}
    for bs in sorted({bs for e in ok for bs in e.latency_ms}, key=int):
        best: EngineValidation | None = None
        for e in (e for e in ok if bs in e.latency_ms):
            if best is None or e.latency_ms[bs].p50 < best.latency_ms[bs].p50 * (1 - margin):
                best = e
        if best is not None:
            chosen[bs] = best.name
    return chosen


def torch_reference(
    ctx: StageContext[ValidateSettings], data: DatasetSplits, cfg: ValidateConfig
) -> tuple[Reference, Any]:
    """The trained PyTorch model (FP32, CPU) as the reference; also the model, for the baselines."""
    model = load_trained(ctx.inputs["train"], ctx.config.model)
    names = input_names(model, data.val_x)
    n = rows(data.val_x) if cfg.max_samples is None else min(cfg.max_samples, rows(data.val_x))
    feed = as_feed(take(data.val_x, slice(0, n)), names)
    axes = ctx.config.signature.dynamic_axes
    sizes = axis_sizes(
        [as_feed(data.train_x, names), feed] if rows(data.train_x) else [feed], axes, ctx.config.signature.shapes
    )
    feeds = [(p, resize(feed, axes, p)) for p in shape_points(sizes)]

    def run(f: Feed) -> dict[str, np.ndarray]:
        with torch.inference_mode():
            return {k: v.float().numpy() for k, v in named_outputs(model, from_feed(f, data.val_x)).items()}

    with torch.inference_mode():
        out_names = list(named_outputs(model, from_feed(feed_take(feed, slice(0, 2)), data.val_x)))
    logits = logits_name(out_names, ctx.config.signature.logits_output)
    labels = data.val_y[:n].numpy() if data.val_y is not None and data.classification else None
    return Reference(
        run,
        feeds,
        labels_at_points(labels, feed, feeds, axes),
        logits,
        max(ctx.config.signature.batch_sizes),
        min(ctx.config.signature.batch_sizes),
    ), model


def onnx_reference(
    ctx: StageContext[ValidateSettings], data: DatasetSplits, cfg: ValidateConfig
) -> tuple[Reference, Any]:
    """Started from ``model.onnx`` with no PyTorch model: the FP32 ONNX file in ONNX Runtime (CPU) is the reference."""
    path = Path(ctx.config.model.onnx)
    sess = ort_session(path)
    inputs, outputs = io_specs(load_onnx(path, load_external_data=False))
    names = [i.name for i in inputs]
    n = rows(data.val_x) if cfg.max_samples is None else min(cfg.max_samples, rows(data.val_x))
    feed = feed_for_graph(take(data.val_x, slice(0, n)), names, f"model.onnx {path.name}")
    axes = ctx.config.signature.dynamic_axes or graph_axes(inputs)
    train = [feed_for_graph(data.train_x, names)] if rows(data.train_x) else []
    feeds = [
        (p, resize(feed, axes, p)) for p in shape_points(axis_sizes(train + [feed], axes, ctx.config.signature.shapes))
    ]
    out_names = [o.name for o in outputs]

    def run(f: Feed) -> dict[str, np.ndarray]:
        return dict(zip(out_names, sess.run(None, f)))

    labels = data.val_y[:n].numpy() if data.val_y is not None and data.classification else None
    return Reference(
        run,
        feeds,
        labels_at_points(labels, feed, feeds, axes),
        logits_name(out_names, ctx.config.signature.logits_output),
        max(ctx.config.signature.batch_sizes),
        min(ctx.config.signature.batch_sizes),
    ), sess


@dataclass(frozen=True)
class ValidateSettings(StageSettings):
    """What validation reads: its section (timing, gates, baselines), the model and data the reference comes from,
    the signature (batch sizes, shapes, logits output) and whether slower reduced precision is dropped."""

    SOURCES = {"require_speedup": "precision.require_speedup"}
    seed: int
    model: ModelConfig
    data: DataConfig
    validate: ValidateConfig
    signature: Signature
    require_speedup: bool


def run(ctx: StageContext[ValidateSettings]) -> ValidationResult:
    cfg = ctx.config.validate
    torch.manual_seed(ctx.config.seed)
    data = ctx.dataset()
    from_torch = torch_model_named(ctx.config.model)
    ref, model = (torch_reference if from_torch else onnx_reference)(ctx, data, cfg)
    check_batch_fits(
        [TensorSpec(name=k, shape=["batch", *v.shape[1:]], dtype=v.dtype.name) for k, v in ref.feed.items()],
        max(ctx.config.signature.batch_sizes),
    )
    accuracy = None
    if ref.logits is not None and ref.labels is not None:
        accuracy = label_accuracy(ref.outputs[-1][ref.logits], ref.labels)
    n = feed_rows(ref.feed)
    dirs = engine_dirs(ctx.inputs["build"])
    metas = [read_metadata(d) for d in dirs]
    devices = baseline_devices({m.device for m in metas if runnable(m)[0]}, cfg.cpu_baseline)
    if from_torch:
        baselines = measure_baselines(model, devices, ref.feed, data.val_x, n, cfg, ctx)
    else:  # started from model.onnx: the FP32 graph in ONNX Runtime on the CPU is the baseline
        baselines = [
            Baseline(
                backend="onnxruntime",
                accuracy=None,
                samples=n,
                latency_ms={
                    str(bs): percentiles(_time_session(model, sample_batch(ref.feed, bs), cfg))
                    for bs in ctx.config.signature.batch_sizes
                },
            )
        ]
    labelled = ref.labelled(len(ref.feeds) - 1)
    cpu = [b for b in baselines if b.device == "cpu" and (b.kind == cfg.baselines[0] or not from_torch)]
    baseline = cpu[0] if cpu else Baseline(accuracy=None, samples=n, latency_ms={})  # computed, not timed, here
    for b in {id(b): b for b in [*baselines, baseline]}.values():
        b.accuracy = accuracy  # the same weights in FP32 (eager or compiled): the CPU reference's accuracy
        b.logits_output, b.compared, b.shapes = ref.logits, list(ref.outputs[-1]), [p for p, _ in ref.feeds if p]
        b.labelled_positions = None if labelled is None else int(labelled.sum())
    if baseline.error:  # the accuracy reference must have numbers: eager on the CPU
        baseline = Baseline(
            accuracy=accuracy,
            samples=n,
            latency_ms={},
            error=baseline.error,
            labelled_positions=baseline.labelled_positions,
        )
    if ref.logits is None:
        ctx.log.info(
            "no class-logit output among %s: engines compared by error and cosine per output, without "
            "top-1 agreement or accuracy (set signature.logits_output to name one)",
            baseline.compared,
        )
    engines = [validate_engine(d, ref, baselines, cfg, ctx) for d in dirs]
    validated = [e for e in engines if e.status == "validated"]
    failures = [f"{e.name}: {f}" for e in validated for f in e.failures]
    if not validated:
        failures.append("no engine could be validated on this machine")
    speed = speed_vs_fp32(engines)  # reduced precision that is not faster than FP32: flagged, or dropped
    dropped = drop_slower(engines, speed) if ctx.config.require_speedup else []
    for row in speed:
        if row["slower"]:
            ctx.log.warning(
                "%s is slower than FP32 at batch %s (%.2fx)%s",
                row["engine"],
                row["largest_batch"],
                row["vs_fp32"][row["largest_batch"]],
                ": not packaged (precision.require_speedup)" if row["engine"] in dropped else "",
            )
    chosen = choose(engines, preference_order(), cfg.choice_margin)
    result = ValidationResult(
        passed=not failures,
        baseline=baseline,
        baselines=baselines,
        engines=engines,
        failures=failures,
        speed_vs_fp32=speed,
        dropped=dropped,
        chosen=chosen,
    )
    result.write(ctx.out / "validation.json")
    for e in engines:
        ctx.log.info("%s: %s", e.name, e.status)
    return result


def _time_session(sess: Any, feed: Feed, cfg: ValidateConfig) -> list[float]:
    """ms per ONNX Runtime call (the reference graph of a run started from model.onnx)."""
    for _ in range(cfg.warmup):
        sess.run(None, feed)
    return time_calls(lambda: sess.run(None, feed), cfg.iterations, cuda=False, budget_s=cfg.time_budget_s)


def _env(cfg: ValidateSettings) -> dict[str, Any]:
    return environment_subset("torch", "onnxruntime", *backend_libraries(), device=True)


# Engines run through kiln.stages.engines' runners, and the baseline is built from kiln.models: their code is part
# of the result.
STAGE = Stage(
    "validate",
    run,
    ("train", "build"),
    ValidateSettings,
    ValidationResult,
    (kiln.stages.validate, kiln.stages.engines, kiln.models, model_io, precision_speed),
    _env,
    "accuracy and latency of every engine vs PyTorch, with gates",
    data=("dataset", "onnx"),
    report=report_section,
)
