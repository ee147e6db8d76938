"""Validate stage: every engine against the PyTorch model on held-out data, for accuracy and latency.

Accuracy: max abs error, cosine similarity, top-1 agreement, task accuracy. Latency: p50/p90/p99 after
warm-up at each configured batch size, with the PyTorch baseline measured in the same run. Gates decide
``passed``; the runner turns a failed gate into a non-zero exit.
"""

from __future__ import annotations

import ast
import logging
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

from kiln.core.compare import class_axis, compare_arrays, value_ordered
from kiln.core.data import (
    DatasetSplits,
    Feed,
    as_feed,
    feed_for_graph,
    feed_rows,
    feed_take,
    from_feed,
    input_names,
)
from kiln.core.inputs import check_batch_fits
from kiln.core.labels import accuracy as label_accuracy
from kiln.core.onnx_io import io_specs, load_onnx, ort_session
from kiln.core.output_names import detection_scores
from kiln.core.outputs import SINGLE_OUTPUT, class_logits, host_arrays, logits_name, named_outputs
from kiln.core.records import (
    NONE_VALIDATED,
    Baseline,
    EngineMetadata,
    EngineValidation,
    Memory,
    Percentiles,
    TensorSpec,
    ValidationResult,
)
from kiln.core.shapes import Axes, graph_axes_with
from kiln.core.stage import StageContext
from kiln.core.text import FEATURE_NAMES
from kiln.core.threads import lowered_from
from kiln.core.timing import BUSY_SPREAD, Timer, interleave, ratio_interval, time_calls, warm_up
from kiln.models.model_io import load_trained, on_random_inputs, torch_model_named
from kiln.stages.accuracy.check import (
    LATENCY_GATE,
    Comparison,
    Reference,
    batched,
    compare_on,
    gated_list,
    gates_for,
    held_out,
    held_out_reference,
    own_feed,
    own_point,
    reference_nan,
    regression,
    sample_batch,
    summarize,
)
from kiln.stages.accuracy.metrics import BOX_FORMAT, Metric, metric_labels, worse_than_mean_note
from kiln.stages.accuracy.refusal import reference_error
from kiln.stages.engines.backend import engine_dirs, read_metadata
from kiln.stages.engines.registry import backend_named, load_engine, preference_order, runnable
from kiln.stages.precision.speed import drop_slower, speed_vs_fp32
from kiln.stages.validate.baselines import from_rounds, prepare_baseline, speedups
from kiln.stages.validate.config import ValidateConfig
from kiln.stages.validate.coupling import rows_may_mix
from kiln.stages.validate.declaration import NOT_BUILT, REQUIRED, UNVALIDATED, ValidateSettings
from kiln.stages.validate.direct import FEW_ROWS
from kiln.stages.validate.gates import check_gates
from kiln.stages.validate.measured import NO_FINITE_FIX, has_no_number_samples, nothing_measured, unmeasured
from kiln.stages.validate.memory import PeakMemory, wait_a_sample
from kiln.stages.validate.report import NAMED_PREDICTION
from kiln.stages.validate.roofline import peak_tflops, roofline

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


def required_failures(required: list[str], engines: list[EngineValidation], dropped: list[str]) -> list[str]:
    """A failure for each precision of ``precision.required`` with no engine validated, passed and kept (not
    ``dropped`` as slower), saying which of those it lacks: a run asked to deliver INT8 must not pass on its FP32
    engines alone."""
    out = []
    for p in required:
        mine = [e for e in engines if e.precision == p]
        if any(e.status == "validated" and e.passed and e.name not in dropped for e in mine):
            continue
        if not mine:
            why = f"no {p} {NOT_BUILT}"
        elif all(e.status != "validated" for e in mine):
            reasons = "; ".join(dict.fromkeys(e.reason for e in mine if e.reason))
            why = f"{p} engines {UNVALIDATED} ({', '.join(e.name for e in mine)}{': ' + reasons if reasons else ''})"
        elif any(e.status == "validated" and e.passed for e in mine):
            slower = [e.name for e in mine if e.name in dropped]
            why = f"every {p} engine that passed was slower and dropped ({', '.join(slower)})"
        else:
            why = f"no {p} engine passed its gates"
        out.append(f"{REQUIRED}{why}")
    return out


def engine_hints(meta: EngineMetadata, failures: list[str]) -> list[str]:
    """What to try when an engine missed accuracy gates: its backend's hints (the way it was built may explain);
    where nothing was measured (:func:`~kiln.stages.validate.measured.nothing_measured`), inputs the model gives
    a number at, which no way of building changes."""
    empty = unmeasured(failures)
    accuracy = [f for f in failures if not f.startswith(LATENCY_GATE) and f not in empty]
    return (backend_named(meta.backend).hints(meta, accuracy) if accuracy else []) + ([NO_FINITE_FIX] if empty else [])


@dataclass
class Checked:
    """An engine after its accuracy pass: its entry, and while it stays loaded for the interleaved timing, its runner
    and a timer per batch size."""

    entry: EngineValidation
    meta: EngineMetadata | None = None
    runner: Any = None
    timers: dict[int, Timer] = field(default_factory=dict)
    found: Comparison | None = None
    unmeasured: list[str] = field(default_factory=list)  # outputs with nothing compared at a shape: failures


def check_engine(engine_dir: Path, ref: Reference, cfg: ValidateConfig, ctx: StageContext[ValidateSettings]) -> Checked:
    """Load the engine (peak memory measured), compare it with the reference at every shape and batch size (the
    entry's headline over the outputs its gates hold), and warm it up for timing; the runner stays active until
    :func:`finish_engine`."""
    meta = read_metadata(engine_dir)
    entry = EngineValidation.of(meta, "not-runnable")
    ok, why = runnable(meta)
    if not ok:
        entry.reason = why
        return Checked(entry)
    sizes = ctx.config.signature.batch_sizes
    first = next((feed for _, feed in ref.feeds if takes_shape(meta, feed)), None)
    if first is None:
        entry.failures = [f"takes none of the validated shapes {[p for p, _ in ref.feeds]}"]
        entry.status, entry.passed = "validated", False
        return Checked(entry)
    runner = load_engine(engine_dir)  # loads nothing yet: activate() does, inside the memory meter
    try:
        with PeakMemory(meta.device) as mem:  # loading + one call at the largest batch
            runner.activate()
            runner.infer(sample_batch(first, max(sizes)))
            wait_a_sample()
        entry.memory = Memory(peak_mb=mem.peak_mb, method=mem.method, size_bytes=meta.size_bytes)
        found = compare_on(
            ref,
            runner.infer,
            sizes,
            takes=lambda feed: takes_shape(meta, feed),
            inspect=lambda feed, got: declared_shape_problems(meta, feed, got),  # one call, as a server gets it
        )
        entry.gates = gates_for(cfg, meta.precision, ref.logits is None)
        summarize(entry, found.stats, ref.logits, gated_list(entry.gates))  # the headline: what the gates judge
        empty = measured_nothing(ref, runner.infer, found, max(sizes), meta.name)
        entry.accuracy, entry.metric = found.accuracy, found.metric
        entry.shapes = [p for p, _ in ref.feeds if p and p not in found.untaken]
        entry.batch_sizes = list(sizes)  # servers take batches up to the largest (the package stage records them)
        timers = {bs: runner.timer(sample_batch(ref.feed, bs), cfg.warmup, cfg.time_budget_s) for bs in sizes}
    except BaseException:
        runner.deactivate()
        raise
    entry.status = "validated"
    return Checked(entry, meta, runner, timers, found, empty)


def measured_nothing(
    ref: Reference, infer: Callable[[Feed], dict[str, np.ndarray]], found: Comparison, largest: int, engine: str
) -> list[str]:
    """At each shape the engine took, a failure for each output it and the reference hold alike as no number on
    every sample, where nothing was compared (:func:`~kiln.stages.validate.measured.nothing_measured`, which warns
    of some samples only). The engine runs again, in batches of ``largest`` as :func:`compare_on` ran it, only at
    shapes where the reference has such a sample: elsewhere nothing can be set aside on a whole sample."""
    failures = []
    last = len(ref.feeds) - 1
    for i, ((point, feed), expected) in enumerate(zip(ref.feeds, ref.outputs)):
        if point in found.untaken or not has_no_number_samples(ref.unpadded(feed, expected)):
            continue
        got = found.last if i == last and found.last is not None else batched(infer, feed, largest)
        whole, answered = value_ordered(ref.unpadded(feed, expected), ref.unpadded(feed, got), ref.by_value)
        at = " at " + ", ".join(f"{k}={v}" for k, v in point.items()) if point else ""
        failures += nothing_measured(whole, answered, at, f"engine {engine}")
    return failures


def finish_engine(
    c: Checked, ref: Reference, baselines: list[Baseline], cfg: ValidateConfig, largest: int
) -> EngineValidation:
    """Unload the engine; its speedups (with their intervals), the gates it misses (:func:`check_engine` recorded
    them), and hints."""
    entry, meta, found = c.entry, c.meta, c.found
    if c.runner is not None:
        c.runner.deactivate()
    if meta is None or found is None:
        return entry
    entry.speedups, entry.speedup_ci = speedups(meta.device, entry.latency_ms, baselines)
    entry.speedup_vs_baseline = entry.speedups.get(f"eager-{meta.device}", {})
    entry.failures = check_gates(entry, ref.accuracy, entry.gates, largest, ref.metric, ref.metric_value)
    entry.failures += c.unmeasured + found.problems
    entry.passed = not entry.failures
    entry.hints = engine_hints(meta, entry.failures)
    if found.untaken:
        fixed = [f"{s.name} {list(s.shape)}" for s in meta.inputs]
        scored = ref.score is not None and ref.feeds[ref.score][0] in found.untaken
        unmeasured = "; task accuracy, measured there, not measured for it" if scored else ""
        entry.hints.append(
            f"takes one size on some axes ({', '.join(fixed)}): not validated at {found.untaken}{unmeasured}"
        )
    return entry


def add_roofline(checked: list[Checked], cache_dir: Path | None) -> dict[str, dict[str, Any]]:
    """Each timed engine's achieved TFLOP/s and share of its device's peak (measured once per device, cached)."""
    peaks: dict[str, dict[str, Any]] = {}
    for c in checked:
        flops = (c.meta.audit.get("flops_per_sample") if c.meta is not None else None) or 0
        if not flops or not c.entry.latency_ms:
            continue
        if c.entry.device not in peaks:
            peaks[c.entry.device] = peak_tflops(c.entry.device, cache_dir)
        c.entry.flops_per_sample = flops
        c.entry.precision_share = c.meta.audit.get("share") or {}
        covers = c.meta.audit.get("share_covers_nodes", 1.0)  # under 1: FLOPs of nodes it could not count are left out
        c.entry.roofline = roofline(c.entry, flops, peaks[c.entry.device], covers)
        for row in c.entry.roofline.values():
            row.update(uncounted_share(c.meta.audit))
    return peaks


def uncounted_share(audit: dict[str, Any]) -> dict[str, Any]:
    """Where compute nodes the audit could not count leave a precision's share unsure (its ``share_floor`` below its
    ``share``), the floor and those nodes by op (``uncounted_ops``), for the roofline rows the report reads: a share
    of the counted FLOPs alone would read "int8 100%" for an engine whose uncounted Einsum may run in FP32."""
    share, floor = audit.get("share") or {}, audit.get("share_floor") or {}
    if not audit.get("uncounted_ops") or not any(floor.get(k, x) < x for k, x in share.items()):
        return {}
    return {"share_floor": floor, "uncounted_ops": audit["uncounted_ops"]}


def time_interleaved(
    contenders: dict[str, dict[int, Timer]], sizes: list[int], cfg: ValidateConfig, ctx: StageContext[ValidateSettings]
) -> tuple[dict[str, dict[str, Percentiles]], dict[str, Any]]:
    """Every contender (engines and baselines) at each batch size in interleaved rounds; their percentiles, and how
    the timing went (rounds, the load around it, whether the machine was too busy to time)."""
    out: dict[str, dict[str, Percentiles]] = {name: {} for name in contenders}
    load_before = os.getloadavg()[0]
    threads, why = timing_threads()
    with ctx.progress.task("timing (interleaved rounds)", total=len(sizes)) as bar:
        for bs in sizes:
            timers = {name: t[bs] for name, t in contenders.items() if bs in t}
            if timers:
                calls = cfg.iterations  # per block, fewer once its share of the time budget is spent
                for name, rounds in interleave(timers, cfg.rounds, calls, cfg.time_budget_s).items():
                    out[name][str(bs)] = from_rounds(rounds)
            bar.advance()
    spreads = sorted(p.spread for lat in out.values() for p in lat.values() if p.spread is not None)
    median_spread = spreads[len(spreads) // 2] if spreads else None
    busy = median_spread is not None and median_spread > BUSY_SPREAD
    run = [len(p.rounds) for lat in out.values() for p in lat.values()]
    info = {
        "rounds": max(run) if run else cfg.rounds,  # what ran: at least MIN_ROUNDS, fewer than asked once spent
        "cpus": os.cpu_count(),
        "torch_threads": threads,
        **({"torch_threads_reason": why} if why else {}),
        "load_before": round(load_before, 2),
        "load_after": round(os.getloadavg()[0], 2),
        "median_spread": median_spread,
        "busy": busy,
    }
    if busy:
        ctx.log.warning(
            "the machine was too busy to time: latency intervals are %.0f%% of p50 wide (median; load average %.1f "
            "on %s CPUs); speedups within their intervals are not differences",
            100 * median_spread,
            info["load_after"],
            info["cpus"],
        )
    return out, info


# what the ONNX Runtime engines timed beside a baseline on the lowered threads run on
ORT_THREADS = (
    "ONNX Runtime's CPU engines keep their sessions' own threads (build.onnxruntime intra_op_threads; 0: one per "
    "physical core)"
)


def timing_threads() -> tuple[int, str | None]:
    """PyTorch's threads for the interleaved timing (those it runs on now), and why where they are fewer than its
    own. On a machine with idle cores, its own count: a baseline on fewer threads than an ONNX Runtime engine's
    session would credit the engine with the difference. Where the run lowered the count for the load
    (:func:`~kiln.core.threads.cpu_threads_for_load`), the lowered count: each thread beyond the cores the load
    leaves waits for a time slice at every operator, so a baseline timed on them measures the load, not PyTorch,
    and every speedup over it is that wait."""
    threads, own = torch.get_num_threads(), lowered_from()
    if own is None or own <= threads:
        return threads, None
    load = f"average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    why = f"the load ({load}) left PyTorch {threads} of its {own} threads, and its baselines were timed on those"
    return threads, f"{why}; {ORT_THREADS}"


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


def prepare_baselines(
    model: torch.nn.Module,
    devices: list[str],
    feed: Feed,
    like: Any,
    n: int,
    cfg: ValidateConfig,
    ctx: StageContext[ValidateSettings],
) -> list[tuple[Baseline, dict[int, Timer]]]:
    """Every configured baseline kind on every device in ``devices``, loaded and warmed up on ``feed`` (named inputs,
    called in ``like``'s structure), with its timers for the interleaved rounds."""
    batches = {bs: sample_batch(feed, bs) for bs in ctx.config.signature.batch_sizes}
    runs = [
        (kind, device, precision)
        for device in devices
        for kind in cfg.baselines
        for precision in (cfg.baseline_precisions if device == "cuda" else ["fp32"])
    ]
    out = []
    with ctx.progress.task("preparing PyTorch baselines", total=len(runs)) as bar:
        for kind, device, precision in runs:
            b, timers = prepare_baseline(
                model, kind, device, precision, batches, cfg.warmup, n, like, cfg.time_budget_s
            )
            if b.error:
                ctx.log.warning("PyTorch baseline %s not measured: %s", b.label, b.error)
            out.append((b, timers))
            bar.advance()
    return out


def behind_pytorch(
    engines: list[EngineValidation],
    chosen: dict[str, str],
    onnx_file: bool = False,
    cause: Callable[[EngineValidation], str] | None = None,
) -> dict[str, str]:
    """Batch sizes at which even the chosen engine is slower than the baseline on its own device beyond the
    timing's noise (the paired interval below 1), each said: a user should know that serving PyTorch would be
    faster there (an op the runtime computes slowly, such as ONNX Runtime's DFT on the CPU). ``onnx_file``: a run
    from ``model.onnx`` with no PyTorch model, whose baseline is that file in ONNX Runtime. ``cause``: what in
    the engine's graph may make it slow (:func:`slow_op_note`), said after; '' when nothing is known."""
    by_name = {e.name: e for e in engines}
    baseline = "the input ONNX file" if onnx_file else "PyTorch"
    against = f"{baseline} in ONNX Runtime" if onnx_file else f"{baseline} eager"
    out: dict[str, str] = {}
    causes: dict[str, str] = {}  # engine -> its cause, found once
    for bs, name in chosen.items():
        e = by_name[name]
        label = f"eager-{e.device}"
        ratio, ci = e.speedups.get(label, {}).get(bs), e.speedup_ci.get(label, {}).get(bs)
        if ratio is not None and ci is not None and ci[1] < 1.0:
            out[bs] = (
                f"the fastest validated engine, {name}, runs at {ratio:.2f}x {against} on the {e.device.upper()} "
                f"(95 % interval {ci[0]:.2f}-{ci[1]:.2f}x): {baseline} itself is faster at this batch"
            )
            if not onnx_file and not any(o.backend == "torch" and o.device == e.device for o in engines):
                devices = " with build.torch.devices: [cpu]" if e.device == "cpu" else ""
                out[bs] += f"; the torch backend compiles PyTorch itself: add torch to build.backends{devices}"
            if cause is not None and name not in causes:
                causes[name] = cause(e)
            out[bs] += f"; {causes[name]}" if causes.get(name) else ""
    return out


def slow_op_note(engine: EngineValidation, engine_dir: Path, export: Path) -> str:
    """What in the engine's ONNX graph may make it slower than PyTorch: its Loop nodes (:func:`loop_note`) and, on
    ONNX Runtime's CPU, its DFT/STFT nodes (:func:`dft_note`); '' when nothing is known."""
    notes = [loop_note(engine_dir, export)]
    if engine.backend == "onnxruntime" and engine.device == "cpu":
        notes.append(dft_note(engine_dir, export))
    return "; ".join(n for n in notes if n)


def loop_note(engine_dir: Path, export: Path) -> str:
    """:func:`_loop_note`, or '' where the graphs cannot be read for it (:func:`_note_or_none`)."""
    return _note_or_none(_loop_note, "Loop", engine_dir, export)


def dft_note(engine_dir: Path, export: Path) -> str:
    """:func:`_dft_note`, or '' where the graphs cannot be read for it (:func:`_note_or_none`)."""
    return _note_or_none(_dft_note, "DFT", engine_dir, export)


def _note_or_none(note: Callable[[Path, Path], str], what: str, engine_dir: Path, export: Path) -> str:
    """``note`` of the engine, or '' where its graphs cannot be read for it: a note is no reason to fail
    validation."""
    try:
        return note(engine_dir, export)
    except Exception as exc:  # noqa: BLE001 - an unreadable graph or metadata of another exporter version
        log.debug("no %s note for %s: %s", what, engine_dir.name, exc)
        return ""


def _graph_nodes(engine_dir: Path, op_types: set[str]) -> tuple[str, list[onnx.NodeProto]]:
    """The engine's name and the nodes of ``op_types`` in its ONNX graph (none where the engine is no ONNX graph)."""
    meta = read_metadata(engine_dir)
    file = meta.files.get("model", "")
    if not file.endswith(".onnx"):
        return meta.name, []
    graph = load_onnx(engine_dir / file, load_external_data=False).graph
    return meta.name, [n for n in graph.node if n.op_type in op_types]


def _made_by(export: Path, nodes: set[str]) -> tuple[list[str], str]:
    """The module classes that made ``nodes`` (the export's node metadata) and how a note says them: `` (made by
    Spectral modules spectral)``, '' where the metadata does not name them."""
    made = _modules_of(export, nodes) if export.is_file() else {}
    kinds = sorted({k for k, _ in made.values()})
    names = sorted({m for _, m in made.values()})
    more = ", ..." if len(names) > 4 else ""
    return kinds, f" (made by {'/'.join(kinds)} modules {', '.join(names[:4])}{more})" if made else ""


def _loop_note(engine_dir: Path, export: Path) -> str:
    """What Loop nodes in the engine's ONNX graph cost, and which modules made them (from the export's node
    metadata, which the dynamo exporter writes); '' when the engine is no ONNX graph or holds none. ONNX Runtime
    runs a Loop's body op by op, once per iteration, where PyTorch runs one kernel: an ``nn.EmbeddingBag`` exports
    as a Loop over the bags."""
    name, nodes = _graph_nodes(engine_dir, {"Loop"})
    if not nodes:
        return ""
    kinds, where = _made_by(export, {n.name for n in nodes})
    what = f"{name}'s graph holds {len(nodes)} Loop node{'s' if len(nodes) > 1 else ''}{where}, which ONNX "
    what += "Runtime runs op by op, once per iteration"
    if "EmbeddingBag" in kinds:
        return f"{what}: nn.EmbeddingBag exports as a Loop, an nn.Embedding followed by a sum over the bag does not"
    return f"{what}: control flow in forward (a Python loop over a tensor's values) exports as a Loop"


def _dft_note(engine_dir: Path, export: Path) -> str:
    """The DFT and STFT nodes (torch.fft, torch.stft) in an ONNX Runtime CPU engine's graph, and which modules made
    them; '' when it holds none. ONNX Runtime's CPU kernel for them is a plain implementation, where PyTorch calls
    an optimized FFT library: a likely cause of the engine's lag, said as one (not profiled)."""
    name, nodes = _graph_nodes(engine_dir, {"DFT", "STFT"})
    if not nodes:
        return ""
    counts = Counter(n.op_type for n in nodes)
    held = " and ".join(f"{c} {op}" for op, c in sorted(counts.items()))
    _, where = _made_by(export, {n.name for n in nodes})
    return (
        f"{name}'s graph holds {held} node{'s' if len(nodes) > 1 else ''}{where}, likely a cause: ONNX Runtime's CPU "
        "DFT kernel is a plain implementation, where PyTorch's torch.fft calls pocketfft (or MKL)"
    )


def _modules_of(export: Path, nodes: set[str]) -> dict[str, tuple[str, str]]:
    """``{node: (module class, module path)}`` for ``nodes`` of the exported graph whose metadata names the module
    that made them (the dynamo exporter's ``pkg.torch.onnx`` name scopes and class hierarchy)."""
    out: dict[str, tuple[str, str]] = {}
    for n in load_onnx(export, load_external_data=False).graph.node:
        props = {p.key: p.value for p in n.metadata_props}
        if n.name not in nodes or "pkg.torch.onnx.name_scopes" not in props:
            continue
        try:
            scopes = ast.literal_eval(props["pkg.torch.onnx.name_scopes"])
            classes = ast.literal_eval(props.get("pkg.torch.onnx.class_hierarchy", "[]"))
        except (ValueError, SyntaxError):  # metadata of another exporter version: the count alone is said
            continue
        if len(scopes) >= 2 and len(classes) >= 2 and scopes[-2]:
            path = scopes[-2].removeprefix("model.") if classes[0] == "kiln.core.outputs.FlatModel" else scopes[-2]
            out[n.name] = (classes[-2].rsplit(".", 1)[-1], path)
    return out


def choose(engines: list[EngineValidation], order: list[str], margin: float) -> tuple[dict[str, str], dict[str, str]]:
    """Per batch size, the fastest engine that passed its gates (and was not dropped), and notes where the fastest
    measured was not chosen. Engines are considered in ``order`` (backend preference: TensorRT first); a later one
    takes the choice only where its lead exceeds both ``margin`` and the timing's noise: the 95 % interval of the
    ratio of the two (paired round by round) lies above ``1 + margin``. Without intervals, the p50s decide."""
    rank = {b: i for i, b in enumerate(order)}
    ok = sorted(
        (e for e in engines if e.status == "validated" and e.passed and not e.dropped),
        key=lambda e: (rank.get(e.backend, len(rank)), e.name),
    )
    chosen: dict[str, str] = {}
    notes: dict[str, str] = {}
    for bs in sorted({bs for e in ok for bs in e.latency_ms}, key=int):
        best: EngineValidation | None = None
        for e in (e for e in ok if bs in e.latency_ms):
            if best is None:
                best = e
                continue
            faster = e.latency_ms[bs].p50 < best.latency_ms[bs].p50 * (1 - margin)
            ci = ratio_interval(best.latency_ms[bs].rounds, e.latency_ms[bs].rounds)
            if faster and (ci is None or ci[0] > 1 + margin):
                best = e
            elif faster:
                notes[bs] = kept_note(best.name, e.name, best.latency_ms[bs].over(e.latency_ms[bs]), ci, margin)
        if best is not None:
            chosen[bs] = best.name
            if bs in notes and f"{best.name} kept" not in notes[bs]:  # a later engine's clear lead took it after all
                notes.pop(bs)
    return chosen, notes


def kept_note(kept: str, faster: str, ratio: float, ci: tuple[float, float], margin: float) -> str:
    """Why ``kept`` stays chosen though ``faster`` measured ``ratio`` times faster at p50: its lead is within the
    timing's noise where the 95 % interval ``ci`` of the ratio reaches 1; where the interval lies above 1 the lead is
    real but under validate.choice_margin, and saying "noise" there would be false."""
    interval = f"95 % interval {ci[0]:.2f}-{ci[1]:.2f}x"
    why = (
        f"its lead ({interval}) does not clear validate.choice_margin ({margin * 100:g} %)"
        if ci[0] > 1
        else f"within the timing's noise ({interval})"
    )
    said = f"{faster} measured {ratio:.2f}x faster than {kept} at p50, {why}"
    return f"{said}: {kept} kept (listed first: backend preference, then name)"


def warn_few_rows(log: logging.Logger, n: int, max_samples: int | None, positions: int | None = None) -> None:
    """Warn where the engines are compared on fewer than :data:`FEW_ROWS` held-out rows: every statistic the gates
    judge (cosine, the worst sample's, errors, top-1 agreement, the metric) is then of that few samples, and an
    engine wrong on most inputs may agree with its reference on them (as ``kiln validate`` warns of short
    ``--inputs``). ``positions``: where labels are per position (a node classifier's one graph), how many carry one,
    which top-1 agreement and accuracy count: enough of them are enough samples, and fewer are said beside the
    rows."""
    if n >= FEW_ROWS or (positions is not None and positions >= FEW_ROWS):
        return
    capped = max_samples is not None and max_samples <= n
    rows = "1 held-out row" if n == 1 else f"{n} held-out rows"
    log.warning(
        "validation compares the engines on only %s (%s): their agreement with the reference is measured on that "
        "few samples. Give at least %d rows%s: %s",
        rows if positions is None else f"{rows} holding {positions} labelled positions",
        f"validate.max_samples {max_samples}" if capped else "the data's held-out split holds no more",
        FEW_ROWS,
        "" if positions is None else f" or {FEW_ROWS} labelled positions",
        "raise validate.max_samples" if capped else "a larger held-out split (data.name)",
    )


def own_sizes(ref: Reference, data: DatasetSplits, n: int) -> dict[str, int] | None:
    """The data's own size of each dynamic axis (its held-out inputs as given), which the report says the inputs
    at other validated sizes were cut or lengthened from; None where no dynamic axis is validated."""
    if not any(point for point, _ in ref.feeds):
        return None
    return own_point(own_feed(data, ref.feeds, n), ref.axes) or None


def torch_reference(
    ctx: StageContext[ValidateSettings], data: DatasetSplits, cfg: ValidateConfig
) -> tuple[Reference, Any]:
    """The trained PyTorch model (FP32, CPU) as the reference; also the model, for the baselines."""
    model = load_trained(ctx.inputs["train"], ctx.config.model)
    names = input_names(model, data.val_x)
    sig = ctx.config.signature
    feeds = held_out(data, lambda x: as_feed(x, names), sig.dynamic_axes, sig.shapes, cfg.max_samples)

    def run(f: Feed) -> dict[str, np.ndarray]:
        with torch.inference_mode():
            return host_arrays(named_outputs(model, from_feed(f, data.val_x)))

    with torch.inference_mode():
        out_names = list(named_outputs(model, from_feed(feed_take(feeds[-1][1], slice(0, 2)), data.val_x)))
    return reference(ctx, data, cfg, run, feeds, out_names, sig.dynamic_axes), model


def _coupled(ctx: StageContext[ValidateSettings], probed: list[str]) -> list[str]:
    """The outputs to serve one request per engine call: those the probe saw follow the batch, and those the graph
    computes through a selection over the whole batch (:func:`rows_may_mix`), said once."""
    graph = load_onnx(ctx.inputs["export"] / "model.onnx", load_external_data=False).graph
    mixed = [o for o in rows_may_mix(graph) if o not in probed]
    if mixed:
        ctx.log.warning(
            "outputs %s may depend on the whole batch: they pass through a selection over it (NonZero, Compress or "
            "Unique on batched values: a boolean mask indexing them). The runtime probe found each row it ran alone "
            "equal to that row in the batch, yet requests that differ in what the mask selects could change each "
            "other's answers, so they are served one request per engine call, to be safe",
            mixed,
        )
    return [o.name for o in graph.output if o.name in {*probed, *mixed}] + [
        p for p in probed if p not in {o.name for o in graph.output}
    ]


def onnx_reference(
    ctx: StageContext[ValidateSettings], data: DatasetSplits, cfg: ValidateConfig
) -> tuple[Reference, Any]:
    """Started from ``model.onnx`` with no PyTorch model: the FP32 ONNX file in ONNX Runtime (CPU) is the reference,
    as the export stage took it (a batch axis the file fixed made symbolic there, checked to compute the same rows)."""
    path = ctx.inputs["export"] / "model.onnx"
    graph = load_onnx(path, load_external_data=False)
    sess = ort_session(path)
    inputs, outputs = io_specs(graph)
    names = [i.name for i in inputs]
    sig = ctx.config.signature
    axes = graph_axes_with(sig.dynamic_axes, inputs)  # a partial dynamic_axes keeps the file's other names
    feeds = held_out(
        data,
        lambda x: feed_for_graph(x, names, f"model.onnx {Path(ctx.config.model.onnx).name}"),
        axes,
        sig.shapes,
        cfg.max_samples,
    )
    out_names = [o.name for o in outputs]
    shown = f"model.onnx {Path(ctx.config.model.onnx).name}"

    def run(f: Feed) -> dict[str, np.ndarray]:
        try:
            return dict(zip(out_names, sess.run(None, f)))
        except Exception as exc:  # ONNX Runtime's own error, whatever its type: shapes the graph does not take
            raise reference_error(exc, f, shown, axes, feeds[-1][1]) from None

    return reference(ctx, data, cfg, run, feeds, out_names, axes), sess


def reference(
    ctx: StageContext[ValidateSettings],
    data: DatasetSplits,
    cfg: ValidateConfig,
    run: Callable[[Feed], dict[str, np.ndarray]],
    feeds: list[tuple[dict[str, int], Feed]],
    out_names: list[str],
    axes: Axes,
) -> Reference:
    """The reference's outputs on the held-out ``feeds``, with the labels and ``validate.metric`` they are judged by;
    an output ``signature.logits_output`` names is held to top-1 agreement whatever the data declares."""
    sig = ctx.config.signature
    logits = class_logits(out_names, sig.logits_output, data.val_y, data.num_classes)
    named = sig.logits_output is not None
    return held_out_reference(run, feeds, data, logits, cfg, sig.batch_sizes, axes, named)


def accuracy_absent(ref: Reference, data: DatasetSplits, named: str | int | None = None) -> str | None:
    """Why the reference has no task accuracy, for report.json's ``accuracy_note`` beside ``accuracy: null``
    (report.md words each case where it shows the baseline); None where it has one. ``named``:
    ``signature.logits_output``, whose output, set aside as float targets' prediction, is said to hold it (the
    report then gives that as why no output is the class logits, not the advice to set it)."""
    if ref.accuracy is not None:
        return None
    if data.val_y is None:
        return "the data has no held-out labels (val_y is None)"
    metric = getattr(ref, "metric", None)
    binary = getattr(ref, "binary_at", None) is not None  # a binary classifier's one logit
    if ref.logits is not None and binary and ref.score is not None:
        y = data.val_y
        return (
            f"the labels {str(y.dtype).removeprefix('torch.')}{list(y.shape)} are no 0/1 label per row for "
            f"'{ref.logits}', a binary classifier's one logit"
        ) + (f"; {_scored_by(metric)}" if metric is not None else "")
    if not data.classification:
        y = data.val_y
        packed = (  # num_classes given beside float rows: classes packed with values, which only a metric splits
            f" {str(y.dtype).removeprefix('torch.')}{list(y.shape)} beside num_classes {data.num_classes}, which "
            "hold no class index per row"
            if data.num_classes
            else ""
        )
        return f"the labels are no classes (float targets{packed}): {_scored_by(metric)}{_named_prediction(ref, named)}"
    if ref.logits is None:
        return no_class_logits(list(ref.outputs[-1]) if getattr(ref, "outputs", None) else [], ref, data)
    if ref.score is None:
        return "the labels per position fit no validated size (add the data's own sizes to signature.shapes)"
    return None


def _named_prediction(ref: Reference, named: str | int | None) -> str:
    """Where ``signature.logits_output`` (``named``) names an output the reference holds as no class logits (float
    targets: a regression's prediction, :func:`~kiln.stages.accuracy.check.top1_output`), a clause saying so."""
    if named is None or ref.logits is not None or not getattr(ref, "outputs", None):
        return ""
    return f"; '{logits_name(list(ref.outputs[-1]), named)}', {NAMED_PREDICTION}"


def _scored_by(metric: Metric | None) -> str:
    """What scores float targets instead of task accuracy: ``validate.metric``, the default ``mse``, or nothing
    (0/1 targets shaped like the logits, several outputs the targets' size), said with the setting to give."""
    if metric is None:
        return (
            "no metric scores them: set validate.metric, e.g. multilabel_f1 for 0/1 targets shaped like the logits, "
            "mse for values to predict, or your own pkg.mod:fn"
        )
    if metric.default:
        return f"{metric.name} scores them (the default for float targets: validate.metric is unset)"
    return f"validate.metric '{metric.name}' scores them"


def unscored(ref: Reference, data: DatasetSplits, named: str | int | None = None) -> str | None:
    """Why float targets leave the engines with no task score (no accuracy, no metric: they pass on their agreement
    with the reference alone), with the settings that give one, for a warning; None where something scores them or
    the labels are integer classes (the report says why no output is their logits). ``named``:
    ``signature.logits_output``, which picks the prediction where several outputs could be it."""
    y = metric_labels(data.val_y)
    if ref.accuracy is not None or getattr(ref, "metric", None) is not None or y is None or data.classification:
        return None
    followed = getattr(ref, "followed", None)
    if followed is not None and ref.score is None:
        return (
            f"no task metric scores the float targets {y.dtype}{list(y.shape)} (values per position of output "
            f"'{followed}', which fit the data's own sizes alone, outside the validated sizes): the engines are "
            "judged by their agreement with the reference alone; add the data's sizes to signature.shapes to score "
            "them there"
        )
    last = ref.outputs[-1] if getattr(ref, "outputs", None) else {}
    fit = [n for n, v in last.items() if np.size(v) == y.size]
    ambiguous = len(fit) > 1 and named is None
    fix = "set validate.metric (mse for values to predict, multilabel_f1 for 0/1 targets shaped like the logits, or "
    fix += "your own pkg.mod:fn)"
    if ambiguous:
        named = f"signature.logits_output to the output that is the prediction ({' or '.join(fit)}), which mse scores"
        fix = f"set {named} by default; or {fix.removeprefix('set ')}"
    boxes = _box_outputs(y, last)
    if boxes:
        fix = (
            "set validate.metric: detection_recall, which scores labels [N, M, 5] of (class, x1, y1, x2, y2) against "
            f"the boxes {' or '.join(repr(n) for n in boxes)} and the class scores beside them "
            f"(signature.logits_output names the scores where their name does not say); {BOX_FORMAT}; or your own "
            "pkg.mod:fn"
        )
    if _one_logit_beside_binary(data, y, fit):
        fix = (
            "for a binary classifier's one logit, set num_classes=2 in DatasetSplits (docs/byom.md), which scores "
            f"its decision's accuracy against them; else {fix.removeprefix('set ')}"
        )
    return (
        f"no task metric scores the float targets {y.dtype}{list(y.shape)} ({_why_unscored(data, y, fit, ambiguous)}): "
        f"the engines are judged by their agreement with the reference alone; {fix}"
    )


def _box_outputs(y: np.ndarray, outputs: dict[str, Any]) -> list[str]:
    """The outputs that look like a detector's boxes (``[N, K, 4]``) where the targets look like its labelled
    boxes (``[N, M, 5]``: class, x1, y1, x2, y2): what ``detection_recall`` scores; empty otherwise. The class
    scores of four classes are ``[N, K, 4]`` too: left out where their name tells them (:func:`detection_scores`)."""
    if y.ndim != 3 or y.shape[-1] != 5:
        return []
    scores = detection_scores(list(outputs))
    return [n for n, v in outputs.items() if np.ndim(v) == 3 and np.shape(v)[-1] == 4 and n != scores]


def _one_logit_beside_binary(data: DatasetSplits, y: np.ndarray, fit: list[str]) -> bool:
    """Whether float targets ``y`` are 0/1, one per row (``[N, 1]`` or ``[N]``), without ``num_classes``, beside an
    output with as many values (``fit``): a binary classifier's one logit, whose decision ``num_classes=2`` scores."""
    one_per_row = y.ndim == 1 or (y.ndim == 2 and y.shape[1] == 1)
    return not data.num_classes and bool(fit) and one_per_row and y.size > 0 and bool(np.isin(y, (0, 1)).all())


def _why_unscored(data: DatasetSplits, y: np.ndarray, fit: list[str], ambiguous: bool) -> str:
    """Why no metric is the default for float targets ``y`` (:func:`~kiln.stages.accuracy.metrics.default_metric`):
    ``fit``, the outputs with as many values; ``ambiguous``: several fit and none is named."""
    if data.num_classes:
        return f"num_classes {data.num_classes} is declared beside them, so no default metric applies"
    if not regression(data):
        return "rows that each sum to 1: class scores (soft labels), which no default metric reads"
    if np.isin(y, (0, 1)).all():
        return "0/1 targets: a multi-label head's, whose threshold is yours to say"
    if ambiguous:
        return f"outputs {', '.join(fit)} each have as many values as the targets, and none is named the prediction"
    if not fit:
        return "no output has as many values as the targets"
    return "no single output is their prediction, or a value is not finite"


def no_class_logits(names: list[str], ref: Reference, data: DatasetSplits) -> str:
    """Why no output of ``names`` is held as class logits on labelled data with classes, for the report: the
    outputs' names say none is (several, none ``logits``; one named as features), or the default one's class axis
    is not the data's classes wide (:func:`kiln.stages.accuracy.check.top1_output`)."""
    return f"{_why_no_class_logits(names, ref, data)}: signature.logits_output names the class-logit output"


def _why_no_class_logits(names: list[str], ref: Reference, data: DatasetSplits) -> str:
    """:func:`no_class_logits`'s reason, without its fix."""
    if len(names) > 1 and SINGLE_OUTPUT not in names:
        return f"{len(names)} outputs ({', '.join(names)}), none named '{SINGLE_OUTPUT}'"
    if len(names) == 1 and FEATURE_NAMES.search(names[0]):
        return f"the only output, '{names[0]}', is named as features"
    chosen = logits_name(names, None) if names else None
    output = ref.outputs[-1].get(chosen) if chosen else None
    if output is not None and output.ndim >= 2 and data.num_classes:
        width = output.shape[class_axis(output.ndim)]
        return f"output '{chosen}' has {width} entries on its class axis, the data {data.num_classes} classes"
    return "no output is held as class logits"


def class_axis_outputs(ref: Reference, data: DatasetSplits) -> list[str]:
    """The reference's float outputs with a batch axis (none of its 0-D ``scalars``) and a class axis of
    ``num_classes`` entries: where exactly one is, the class-logit output to name (a ``(logits, aux_loss)`` tuple's
    ``output_0`` beside its 0-D loss)."""
    if not data.num_classes or not getattr(ref, "outputs", None):
        return []
    scalars = set(getattr(ref, "scalars", ()))
    return [
        name
        for name, v in ref.outputs[-1].items()
        if name not in scalars
        and np.ndim(v) >= 2
        and v.dtype.kind == "f"
        and v.shape[class_axis(v.ndim)] == data.num_classes
    ]


def say_no_class_logits(log: logging.Logger, ref: Reference, data: DatasetSplits) -> bool:
    """Warn, where the data has class labels but no output is held as class logits, that no top-1 agreement or
    accuracy gates the engines (a gate weakened without a word on stderr otherwise), with the output to name where
    one alone has a class axis of ``num_classes`` entries. Whether it warned."""
    if ref.logits is not None or data.val_y is None or not data.classification:
        return False
    names = list(ref.outputs[-1]) if getattr(ref, "outputs", None) else []
    fit = class_axis_outputs(ref, data)
    fix = (
        f"set signature.logits_output: {fit[0]}, the one output whose class axis holds the {data.num_classes} classes"
        if len(fit) == 1
        else "set signature.logits_output to the class-logit output"
    )
    log.warning(
        "no top-1 agreement or task accuracy gates the engines, only error and cosine per output: %s; %s",
        _why_no_class_logits(names, ref, data),
        fix,
    )
    return True


def scored_positions(ref: Reference, labelled: np.ndarray | None) -> int | None:
    """How many held-out positions accuracy counts (labels per position); 0 where the labels fit no validated
    shape (:func:`kiln.stages.accuracy.check.scoring_point`: accuracy not measured, its gate not applied), which
    the report says; None: labels per row, or none."""
    if ref.score is None:
        return 0
    return None if labelled is None else int(labelled.sum())


def run(ctx: StageContext[ValidateSettings]) -> ValidationResult:
    cfg = ctx.config.validate
    torch.manual_seed(ctx.config.seed)
    data = ctx.dataset()
    from_torch = torch_model_named(ctx.config.model)
    ref, model = (torch_reference if from_torch else onnx_reference)(ctx, data, cfg)
    for said in reference_nan(ref.outputs):
        ctx.log.warning("%s", said)
    check_batch_fits(
        [TensorSpec(name=k, shape=["batch", *v.shape[1:]], dtype=v.dtype.name) for k, v in ref.feed.items()],
        max(ctx.config.signature.batch_sizes),
    )
    accuracy = ref.accuracy
    n = feed_rows(ref.feed)
    labelled = ref.labelled(ref.score) if ref.score is not None else None
    if not on_random_inputs(ctx.config.model, ctx.config.data):
        warn_few_rows(ctx.log, n, cfg.max_samples, None if labelled is None else int(labelled.sum()))
    dirs = engine_dirs(ctx.inputs["build"])
    metas = [read_metadata(d) for d in dirs]
    devices = baseline_devices({m.device for m in metas if runnable(m)[0]}, cfg.cpu_baseline)
    sizes = ctx.config.signature.batch_sizes
    if from_torch:
        prepared = prepare_baselines(model, devices, ref.feed, data.val_x, n, cfg, ctx)
    else:  # started from model.onnx: the FP32 graph in ONNX Runtime on the CPU is the baseline
        timers = {bs: _session_timer(model, sample_batch(ref.feed, bs), cfg) for bs in sizes}
        prepared = [(Baseline(backend="onnxruntime", accuracy=None, samples=n, latency_ms={}), timers)]
    baselines = [b for b, _ in prepared]
    data_sizes = own_sizes(ref, data, n)
    cpu = [b for b in baselines if b.device == "cpu" and (b.kind == cfg.baselines[0] or not from_torch)]
    baseline = cpu[0] if cpu else Baseline(accuracy=None, samples=n, latency_ms={})  # computed, not timed, here
    for b in {id(b): b for b in [*baselines, baseline]}.values():
        b.accuracy = accuracy  # the same weights in FP32 (eager or compiled): the CPU reference's accuracy
        b.logits_output, b.compared, b.shapes = ref.logits, list(ref.outputs[-1]), [p for p, _ in ref.feeds if p]
        b.scored_at = ref.feeds[ref.score][0] or None if ref.score is not None else None
        b.own_sizes = data_sizes
        b.labelled_positions = scored_positions(ref, labelled)
        b.metric, b.metric_name = ref.metric_value, ref.metric.name if ref.metric is not None else cfg.metric
        b.metric_default = ref.metric is not None and ref.metric.default
        b.metric_scale = ref.metric.scale if ref.metric is not None else None
        b.accuracy_note = accuracy_absent(ref, data, ctx.config.signature.logits_output)
    for said in (
        unscored(ref, data, ctx.config.signature.logits_output),
        worse_than_mean_note(ref.metric, ref.metric_value),
    ):
        if said is not None:
            ctx.log.warning("%s", said)
    if baseline.error:  # the accuracy reference must have numbers: eager on the CPU
        baseline = Baseline(
            accuracy=accuracy,
            samples=n,
            latency_ms={},
            error=baseline.error,
            labelled_positions=baseline.labelled_positions,
            accuracy_note=baseline.accuracy_note,
            metric=baseline.metric,
            metric_name=baseline.metric_name,
            metric_default=baseline.metric_default,
            metric_scale=baseline.metric_scale,
        )
    if ref.logits is None and not say_no_class_logits(ctx.log, ref, data):
        ctx.log.info(
            "no class-logit output among %s: engines compared by error and cosine per output (the whole output's "
            "and its worst sample's), without top-1 agreement or accuracy (class logits: the output "
            "signature.logits_output names, with integer labels or num_classes in the data)",
            baseline.compared,
        )
    checked: list[Checked] = []
    try:
        for d in dirs:
            checked.append(check_engine(d, ref, cfg, ctx))
        contenders = {f"baseline {b.label}": t for b, t in prepared if t}
        contenders.update({c.entry.name: c.timers for c in checked if c.timers})
        latency, timing = time_interleaved(contenders, sizes, cfg, ctx)
        timing.update(timed_at(ref))
    except BaseException:
        for c in checked:
            if c.runner is not None:
                c.runner.deactivate()
        raise
    for b, t in prepared:
        b.latency_ms = latency.get(f"baseline {b.label}", {}) if t else {}
    for c in checked:
        c.entry.latency_ms = latency.get(c.entry.name, {})
    engines = [finish_engine(c, ref, baselines, cfg, max(sizes)) for c in checked]
    peaks = add_roofline(checked, ctx.cache_dir if cfg.roofline else None) if cfg.roofline else {}
    validated = [e for e in engines if e.status == "validated"]
    failures = [f"{e.name}: {f}" for e in validated for f in e.failures]
    if not validated:
        elsewhere = [e.name for e in engines if e.status == "not-runnable"]
        where = f" (built for other devices: {', '.join(elsewhere)})" if elsewhere else ""
        failures.append(f"{NONE_VALIDATED}{where}")
    speed = speed_vs_fp32(engines)  # reduced precision that is not faster than FP32: flagged, or dropped
    # INT8/FP8 slower than the FP16 engine beside it is never the one to serve: dropped in any case
    dropped = drop_slower(engines, speed if ctx.config.require_speedup else [r for r in speed if _under_fp16(r)])
    failures += required_failures(ctx.config.required, engines, dropped)
    for row in speed:
        if row["slower"]:
            judge = row["judged_against"]
            ctx.log.warning(
                "%s is slower than %s at batch %s (%.2fx, 95%% interval %s)%s",
                row["engine"],
                judge.upper(),
                row["largest_batch"],
                row[f"vs_{judge}"][row["largest_batch"]],
                _interval(row.get(f"vs_{judge}_ci", {}).get(row["largest_batch"])),
                ": not packaged" if row["engine"] in dropped else "",
            )
    chosen, notes = choose(engines, preference_order(), cfg.choice_margin)
    for bs, note in notes.items():
        ctx.log.info("batch %s: %s", bs, note)
    engine_dir, export = {m.name: d for m, d in zip(metas, dirs)}, ctx.inputs["export"] / "model.onnx"
    slow_ops = lambda e: slow_op_note(e, engine_dir[e.name], export)  # noqa: E731 - read only for an engine said slower
    # a run from model.onnx: its baseline is that file in ONNX Runtime, with the same Loops
    for bs, note in behind_pytorch(engines, chosen, not from_torch, slow_ops if from_torch else None).items():
        ctx.log.warning("batch %s: %s", bs, note)
        notes[bs] = f"{notes[bs]}; {note}" if bs in notes else note
    result = ValidationResult(
        passed=not failures,
        baseline=baseline,
        baselines=baselines,
        engines=engines,
        failures=failures,
        speed_vs_fp32=speed,
        dropped=dropped,
        chosen=chosen,
        choice_notes=notes,
        batch_coupled=_coupled(ctx, ref.coupled),
        timing=timing,
        peaks=peaks,
        one_class=ref.one_class,
    )
    result.write(ctx.out / "validation.json")
    for e in engines:
        ctx.log.info("%s: %s", e.name, e.status)
    return result


def timed_at(ref: Reference) -> dict[str, dict[str, int]]:
    """``{"timed_at": {axis: size}}``: the sizes of the dynamic axes besides the batch that latency is timed at (the
    last validated shape, the largest: :attr:`Reference.feed`), for validation.json's ``timing``; empty for a model
    without such axes, whose latency depends on the batch alone."""
    point = ref.feeds[-1][0]
    return {"timed_at": dict(point)} if point else {}


def _session_timer(sess: Any, feed: Feed, cfg: ValidateConfig) -> Timer:
    """A warmed-up timer of the reference graph in ONNX Runtime (a run started from model.onnx)."""
    warm_up(lambda: sess.run(None, feed), cfg.warmup, cfg.time_budget_s)

    def timer(calls: int, budget_s: float | None) -> list[float]:
        return time_calls(lambda: sess.run(None, feed), calls, cuda=False, budget_s=budget_s, min_calls=1)

    return timer


def _under_fp16(row: dict[str, Any]) -> bool:
    """A speed row of an INT8/FP8 engine judged against (losing to) the FP16 engine of its backend and device."""
    return row["precision"] in ("int8", "fp8") and row["judged_against"] == "fp16"


def _interval(ci: Any) -> str:
    return f"{ci[0]:.2f}-{ci[1]:.2f}x" if ci else "not measured"
