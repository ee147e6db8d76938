"""``kiln validate ENGINE --reference ...``: one engine folder against an ONNX model or a PyTorch checkpoint,
on the user's inputs (``--inputs x.npz``) or random ones of the engine's declared shapes. No workdir, no cache."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from kiln.core.compare import OutputStats, class_axis, worst_sample
from kiln.core.data import feed_rows
from kiln.core.errors import InputError, InputFileError
from kiln.core.feeds import check_feed, fixed_batch, in_batches, read_feed, rows_per_call, run_batched
from kiln.core.inputs import check_batch_axis, random_inputs, recorded_sizes
from kiln.core.labels import padding_ties, without_padding
from kiln.core.onnx_io import check_tensor_io, io_specs, load_onnx, ort_session, refuse_random_graph
from kiln.core.output_names import SINGLE_OUTPUT, logits_name
from kiln.core.random_ops import RANDOM_HINT
from kiln.core.records import EngineMetadata, EngineValidation, Percentiles, steps_text, takes_size, whole_range
from kiln.core.sample_counts import FEW_ROWS
from kiln.core.shapes import axis_names, graph_axes, refuse_unknown_axes, resize, shape_points
from kiln.core.signature import BATCH_AXIS
from kiln.core.text import FEATURE_NAMES, short_reason
from kiln.stages.accuracy.check import (
    MissedByShape,
    accuracy_failures,
    compare_all,
    direct_top1,
    gated_list,
    gates_for,
    merge_worst,
    placed_failure,
    reference_nan,
    summarize,
    with_nonfinite,
)
from kiln.stages.accuracy.metrics import BUILTINS, Metric, against_reference, resolve_metric
from kiln.stages.engines.backend import check_feed as check_engine_feed
from kiln.stages.engines.backend import read_metadata
from kiln.stages.engines.registry import load_engine
from kiln.stages.validate.declaration import ValidateSettings
from kiln.stages.validate.gates import check_gates
from kiln.stages.validate.measured import NO_FINITE_FIX, nothing_measured
from kiln.stages.validate.reference_text import OTHER_MODEL, RANDOM_VALUES, feed_shapes

log = logging.getLogger("kiln.validate")

Feed = dict[str, np.ndarray]
RANDOM_FIX = "pass --inputs file.npz with concrete arrays"


def reference_outputs(
    reference: Path,
    feed: dict[str, np.ndarray],
    cfg: ValidateSettings,
    batch: int | None = None,
    loaded: dict[str, Any] | None = None,
    random: bool = False,
) -> dict[str, np.ndarray]:
    """Every output of the reference, by name: an ONNX model (ONNX Runtime, CPU; one batch at a time where it fixes
    its batch axis) or a PyTorch checkpoint of ``cfg.model`` (called with the feed's arrays as keyword arguments
    when there are several); ``batch``: rows a call, as the engine is run (None: every row in one call).
    ``loaded``: the reference as an earlier call loaded it (the model, or the graph and its session), kept there, so
    that the checks of several shapes and batch sizes load it once. ``random``: the feed is Kiln's random one, so a
    checkpoint's model that raises on it is said to have met values it may reject, with real samples as the fix."""
    loaded = {} if loaded is None else loaded
    if reference.suffix != ".onnx":
        from kiln.stages.validate.checkpoint import checkpoint_outputs  # torch: a checkpoint's reference only

        return checkpoint_outputs(reference, feed, cfg, batch, loaded, random)
    if "graph" not in loaded:
        loaded["graph"] = load_onnx(reference)
        check_tensor_io(loaded["graph"], f"reference {reference.name}")
    graph = loaded["graph"]
    specs, _ = io_specs(graph)
    if sorted(s.name for s in specs) != sorted(feed):
        raise InputFileError(
            f"reference inputs {sorted(s.name for s in specs)} differ from the engine's/feed's {sorted(feed)}",
            hint="validate an engine against the ONNX model it was built from",
        )
    try:
        check_feed(feed, specs, "the engine's inputs", f"reference {reference.name}", batched=True)  # ranks, sizes
    except InputFileError as exc:
        raise InputError(exc.message, hint=OTHER_MODEL) from None
    ref_sess = loaded["session"] = loaded.get("session") or ort_session(graph)
    names = [o.name for o in ref_sess.get_outputs()]
    try:
        return run_batched(lambda part: dict(zip(names, ref_sess.run(None, part))), feed, fixed_batch(specs) or batch)
    except Exception as exc:  # ONNX Runtime's own error: a size the graph does not take (a 64-row position table)
        inputs = "Kiln's RANDOM inputs of the engine's shapes" if random else "the engine's inputs"
        real = f"with real samples ({RANDOM_VALUES}) " if random else ""
        raise InputError(
            f"reference {reference.name} fails on {inputs} {feed_shapes(feed)} in ONNX Runtime: "
            f"{short_reason(exc, 300)}",
            hint=f"give --inputs {real}at sizes the model takes (the sizes its kiln-engine.json validated), or check "
            "that the inputs are this model's",
        ) from None


def validate_direct(engine_dir: Path, reference: Path, inputs: Path | None, cfg: ValidateSettings) -> EngineValidation:
    """``engine_dir`` against ``reference`` on every row of ``inputs`` (else random ones), at each size the user set
    (:func:`_checks`: every shape point of ``signature.shapes``, each of ``signature.batch_sizes``), the worst of
    every comparison kept; an engine that fixes its batch axis, or whose outputs answer fewer rows a call than it
    may be fed (a batch-of-one graph network's ``[1, nodes, C]``: :func:`~kiln.core.feeds.rows_per_call`), runs
    them one batch of that size at a time, the reference too, so every row is compared. Its latency is timed at the
    largest shape, at each batch size. Its headline values are over the outputs its gates hold
    (``validate.gates.gated_outputs``), as the stage's are."""
    meta = read_metadata(engine_dir)
    metric = _direct_metric(cfg)  # a bad import path is said before anything runs
    _refuse_random_graphs(engine_dir, meta, reference)
    # An engine whose inputs share no batch axis (one built before Kiln refused such graphs): said as what it is, not
    # as the row counts of a feed or as inputs of another model
    check_batch_axis(meta.inputs, f"engine {engine_dir.name}")
    fixed = fixed_batch(meta.inputs) or rows_per_call(meta.inputs, meta.outputs)
    checks = [(feed, fixed or rows) for feed, rows in _checks(meta, inputs, cfg)]
    # The engine's own refusals (a token id past its table) before the reference runs; sizes past those it was
    # validated for are what this command is for: checked here, said in the log
    parts = [in_batches(feed, b) if b is not None else [feed] for feed, b in checks]
    for feed_parts in parts:
        for part in feed_parts:
            check_engine_feed(meta, part, allow_outside_ranges=True)
        _say_new_sizes(meta, feed_parts[0])
    loaded: dict[str, Any] = {}  # the reference, loaded once for every check
    refs = [reference_outputs(reference, feed, cfg, b, loaded, random=inputs is None) for feed, b in checks]
    for said in reference_nan(refs):  # as the pipeline's validation warns of its reference's NaN
        log.warning("%s", said)
    gots, times = _run(engine_dir, meta, checks, parts, cfg)
    setting = _logits_setting(cfg, meta, list(refs[0]))
    logits = direct_top1(list(refs[0]), setting, refs[0])
    entry = EngineValidation.of(meta, "validated")
    decisions = _recorded_decisions(meta, logits)
    kept, unmeasured, each = _compared(meta, [feed for feed, _ in checks], refs, gots, logits, decisions)
    entry.gates = gates_for(cfg.validate, meta.precision, logits is None)
    summarize(entry, kept, logits, gated_list(entry.gates))  # the headline: what the gates judge
    _say_no_top1(refs[0], setting, logits, entry)
    entry.latency_ms = {str(batch): Percentiles.of(times[batch]) for batch in sorted(times)}
    entry.batch_sizes = sorted(times)
    sizes = [_named_sizes(meta, feed) for feed, _ in checks]
    entry.shapes = [size for i, size in enumerate(sizes) if size and size not in sizes[:i]]
    _say_unvalidated_ranges(meta, sizes)
    missed = _missed_by_shape(meta, sizes, each, logits, entry.gates)
    entry.metric, baseline = _scored(metric, refs, gots) if metric is not None else (None, None)
    failures = check_gates(entry, None, entry.gates, max(times), metric, baseline)
    entry.failures = [placed_failure(f, missed)[0] for f in failures] + unmeasured
    entry.passed = not entry.failures
    entry.hints = [NO_FINITE_FIX] if unmeasured else []
    return entry


def _direct_metric(cfg: ValidateSettings) -> Metric | None:
    """``validate.metric`` as this command scores it (None: not set, or a built-in): its inputs carry no labels, so,
    as in a run on unlabelled data (:func:`~kiln.stages.accuracy.metrics.against_reference`), a metric of the
    user's scores the engine's outputs against the reference's, and the reference's score of itself is the baseline
    ``max_metric_drop`` holds the engine to. A built-in reads labels of a task: it is resolved, and said once not to
    be scored, rather than failing a command whose config is a run's."""
    metric = resolve_metric(cfg.validate.metric, None, cfg.validate.metric_higher_is_better)
    if metric is None:
        return None
    if metric.name in BUILTINS:
        log.warning(
            "validate.metric '%s' is not scored here: a built-in metric reads labels, and --inputs carry none (a "
            "metric of yours, pkg.mod:fn, would score the engine's outputs against the reference's)",
            metric.name,
        )
        return None
    log.info(
        "validate.metric '%s' scores the engine's outputs against the reference's: --inputs carry no labels",
        metric.name,
    )
    return against_reference(metric)


def _scored(metric: Metric, refs: list[Feed], gots: list[Feed]) -> tuple[float, float]:
    """``metric`` of the engine's outputs and of the reference's own (its labels, a perfect match: the baseline) at
    the check where the engine's drop is largest, as the other comparisons keep their worst. Each call gets copies:
    the metric may write into what it is given."""
    scores = [(metric(_copy(got), _copy(ref)), metric(_copy(ref), _copy(ref))) for ref, got in zip(refs, gots)]
    return max(scores, key=lambda s: metric.drop(s[1], s[0]))


def _copy(outputs: Feed) -> Feed:
    return {k: np.array(v) for k, v in outputs.items()}


def _run(
    engine_dir: Path,
    meta: EngineMetadata,
    checks: list[tuple[Feed, int | None]],
    parts: list[list[Feed]],
    cfg: ValidateSettings,
) -> tuple[list[Feed], dict[int, list[float]]]:
    """The engine's outputs on each check's feed (in its calls' rows), and its latency by the batch timed (the
    engine's fixed one, else a call's rows) at the largest shape (the last of :func:`~kiln.core.shapes.shape_points`),
    once per batch size there: one timing where the user set no sizes."""
    largest = _named_sizes(meta, checks[-1][0])
    times: dict[int, list[float]] = {}
    with load_engine(engine_dir) as runner:
        gots = [run_batched(lambda part: runner.infer(part, allow_outside_ranges=True), f, b) for f, b in checks]
        for (feed, _), feed_parts in zip(checks, parts):
            if _named_sizes(meta, feed) == largest:
                batch = len(next(iter(feed_parts[0].values())))
                times[batch] = runner.time_ms(feed_parts[0], cfg.validate.warmup, cfg.validate.iterations)
    return gots, times


def _checks(meta: EngineMetadata, inputs: Path | None, cfg: ValidateSettings) -> list[tuple[Feed, int | None]]:
    """The feeds the engine is compared on, each with the rows a call takes (None: every row in one call): at each
    shape point of ``signature.shapes`` (:func:`~kiln.core.shapes.shape_points`: the smallest sizes together, the
    corners, the largest together, as the pipeline's validation runs them), each batch size of
    ``signature.batch_sizes``, where the user set them (a config or ``--set``). ``inputs`` are resized to each point
    (their own values repeated or cut, as ``kiln precision`` judges at its shapes) and fed all, in calls of each
    batch size; random inputs are drawn at each point with a batch size's rows. Not set: ``inputs`` as they are, in
    one call, else random inputs at the largest size of each range the engine records and the largest batch size
    (at most the largest the engine takes: :meth:`~kiln.core.records.EngineMetadata.max_batch`)."""
    sig = cfg.signature
    given = sig.model_fields_set
    shapes = dict(sig.shapes) if "shapes" in given else {}
    refuse_unknown_axes(shapes, axis_names(meta.inputs))
    points = shape_points({k: v for k, v in shapes.items() if v})
    batches: list[int | None] = sorted(set(sig.batch_sizes)) if "batch_sizes" in given else [None]
    if points != [{}] or batches != [None]:
        said = ", ".join(" ".join(f"{k}={v}" for k, v in p.items()) for p in points if p)
        log.info("validating at %s%s", said or "the inputs' sizes", f", batch {batches}" if batches != [None] else "")
    if inputs is not None:
        data = read_feed(inputs, meta.inputs, batched=True)
        _warn_few_rows(inputs, data)
        axes = graph_axes(meta.inputs)
        return [(resize(data, axes, p, repeat_floats=True) if p else data, b) for p in points for b in batches]
    _say_random_values(meta)
    recorded: dict[str, dict[int, int]] | None = None
    out: list[tuple[Feed, int | None]] = []
    limit = meta.max_batch()  # a batch size not set: the largest the engine takes (validated, or its profile's)
    most = min(max(sig.batch_sizes), limit) if limit else max(sig.batch_sizes)
    for point in points:
        if recorded is None and any(d not in point for d in axis_names(meta.inputs)):
            recorded = recorded_sizes(meta.inputs, meta.axis_ranges, "RANDOM inputs")  # said once, where used
        dynamic = _point_sizes(meta, point, recorded or {})
        for b in batches:
            rows = b or most
            feed = random_inputs(
                meta.inputs,
                batch=rows,
                dynamic=dynamic,
                hint=RANDOM_FIX,
                int_ranges=meta.index_ranges,
                float_ranges=meta.value_ranges,
            )
            out.append((feed, b))
    return out


def _say_random_values(meta: EngineMetadata) -> None:
    """Warn which values the random inputs hold: those in a range the engine's record gives (``value_ranges`` for
    floats, ``index_ranges`` for ids) are drawn within it, said with it; float inputs with none are drawn from
    N(0, 1), far from what an engine calibrated on other values (images in [0, 1]) was made for: it may fail there
    while fine on its real inputs, or pass on values that mean nothing, so real samples (``--inputs``) are the fix."""
    recorded = {**meta.value_ranges, **{k: whole_range(v) for k, v in meta.index_ranges.items()}}  # as drawn
    ranged = {s.name: recorded[s.name] for s in meta.inputs if s.name in recorded}
    normal = [s.name for s in meta.inputs if s.name not in ranged and np.dtype(s.dtype).kind == "f"]
    if ranged:
        said = ", ".join(f"{name} [{low:g}, {high:g}]" for name, (low, high) in ranged.items())
        log.warning("random inputs drawn in each input's recorded range: %s", said)
    if normal:
        log.warning(
            "random inputs drawn from N(0, 1) for %s: engine %s records no value range for them, and an engine "
            "calibrated on other values (images in [0, 1]) may fail on N(0, 1) while fine on real data, or pass on "
            "values that mean nothing. Give --inputs FILE.npz with real samples",
            ", ".join(f"'{name}'" for name in normal),
            meta.name,
        )


def _warn_few_rows(inputs: Path, feed: Feed) -> None:
    """Warn where ``--inputs`` holds fewer than :data:`FEW_ROWS` rows: every statistic the gates judge (cosine, the
    worst sample's, errors, top-1 agreement) is then of that few samples, and an engine wrong on most inputs may
    agree with its reference on them (``kiln precision`` warns alike of few calibration rows)."""
    rows = feed_rows(feed)
    if rows < FEW_ROWS:
        log.warning(
            "--inputs %s holds only %s: the engine's agreement with the reference is measured on that few samples. "
            "Give at least %d rows of real inputs",
            inputs,
            "1 row" if rows == 1 else f"{rows} rows",
            FEW_ROWS,
        )


def _point_sizes(
    meta: EngineMetadata, point: dict[str, int], recorded: dict[str, dict[int, int]]
) -> dict[str, dict[int, int]]:
    """Each input's named axes at their sizes in ``point``, the others at ``recorded`` (the engine's own largest),
    per input and axis (:func:`random_inputs`' form)."""
    out = {name: dict(axes) for name, axes in recorded.items()}
    for spec in meta.inputs:
        for axis, dim in enumerate(spec.shape):
            if axis and isinstance(dim, str) and dim in point:
                out.setdefault(spec.name, {})[axis] = point[dim]
    return out


def _recorded_decisions(meta: EngineMetadata, logits: str | None) -> bool:
    """Whether ``logits`` are the multi-label head the engine's run held to decision agreement (``kiln-engine.json``'s
    ``logits_agreement``): each (sample, label) pair's decision is compared then, as the run compared them, not the
    argmax of labels that are no classes of one answer."""
    decisions = logits is not None and logits == meta.logits_output and meta.logits_agreement == "decision"
    if decisions:
        log.info("class logits '%s' are a multi-label head's: held to decision agreement, as the engine's run", logits)
    return decisions


def _compared(
    meta: EngineMetadata,
    feeds: list[Feed],
    refs: list[Feed],
    gots: list[Feed],
    logits: str | None,
    decisions: bool = False,
) -> tuple[dict[str, OutputStats], list[str], list[dict[str, OutputStats]]]:
    """Every output of each check compared (padding left out), the worst of each statistic over the checks, the
    outputs with nothing measured in any of them, and each check's own statistics; ``decisions``: the logits are a
    multi-label head's (:func:`_recorded_decisions`)."""
    axes, out_axes = graph_axes(meta.inputs), graph_axes(meta.outputs)
    whole = [o.name for o in meta.outputs if not o.shape]  # no batch axis: compared over its norm, stacked or not
    kept: dict[str, OutputStats] = {}
    unmeasured: list[str] = []
    each: list[dict[str, OutputStats]] = []
    for feed, ref, got in zip(feeds, refs, gots):
        for name, r in ref.items():
            if name in got and got[name].shape != r.shape:
                raise InputFileError(
                    f"engine output '{name}' has shape {got[name].shape}, the reference's {r.shape}",
                    hint="the engine was built from a different model",
                )
        # No labels: accuracy is agreement with the reference, already gated. Every output is compared.
        _say_padding_ties(feed, ref, axes, out_axes)
        unpadded_ref, unpadded_got = (
            without_padding(feed, ref, axes, out_axes),
            without_padding(feed, got, axes, out_axes),
        )
        stats = compare_all(
            unpadded_ref, unpadded_got, logits, mismatch_hint=OTHER_MODEL, decisions=decisions, whole=whole
        )
        stats = with_nonfinite(stats, unpadded_ref, unpadded_got)  # a cosine of NaN names the side without a number
        stats = _samples_along_batch(meta, feed_rows(feed), unpadded_ref, unpadded_got, stats)
        each.append(stats)
        kept = merge_worst(kept, stats) if kept else stats
        unmeasured += [u for u in nothing_measured(ref, got) if u not in unmeasured]
    return kept, unmeasured, each


def _missed_by_shape(
    meta: EngineMetadata,
    sizes: list[dict[str, int]],
    each: list[dict[str, OutputStats]],
    logits: str | None,
    gates: dict[str, Any],
) -> MissedByShape:
    """The accuracy gates missed at each shape compared (``sizes``: each check's, ``each``: its statistics; the checks
    of one shape at several batch sizes judged together), where there are several shapes: none where there is one."""
    points: list[dict[str, int]] = [p for i, p in enumerate(sizes) if p not in sizes[:i]]
    if len(points) < 2:
        return []
    missed = []
    for point in points:
        stats: dict[str, OutputStats] = {}
        for size, s in zip(sizes, each):
            if size == point:
                stats = merge_worst(stats, s) if stats else s
        there = EngineValidation.of(meta, "validated")
        summarize(there, stats, logits, gated_list(gates), warn=False)  # per shape: the headline warned already
        missed.append((point, accuracy_failures(there, gates, None)))
    return missed


def batch_axis(meta: EngineMetadata, name: str, shape: tuple[int, ...], rows: int) -> int | None:
    """The axis of output ``name`` (of ``shape``, on ``rows`` samples) that holds the samples, as the engine's
    record declares it (named ``batch``): the one such axis, or where several carry the name (an exporter's
    ``['batch', 'batch', 11]`` for a time-major ``[T, N, C]``) the one of them as long as the samples; None where
    the record declares none, or cannot tell them apart."""
    spec = next((o for o in meta.outputs if o.name == name), None)
    if spec is None or len(spec.shape) != len(shape):
        return None
    named = [i for i, dim in enumerate(spec.shape) if dim == BATCH_AXIS]
    if len(named) > 1:
        named = [i for i in named if shape[i] == rows]
    return named[0] if len(named) == 1 else None


def _samples_along_batch(
    meta: EngineMetadata, rows: int, ref: Feed, got: Feed, stats: dict[str, OutputStats]
) -> dict[str, OutputStats]:
    """``stats`` with the worst sample of each output whose samples lie on another axis than 0
    (:func:`batch_axis`: a time-major ``[T, N, C]``) taken along that axis: its rows are time steps, and the worst
    of them no sample the user can look up."""
    out = dict(stats)
    for name, s in stats.items():
        axis = batch_axis(meta, name, ref[name].shape, rows) if name in ref and name in got else None
        if axis and s.sample_cosine is not None:
            cosine, row = worst_sample(ref[name], got[name], axis)
            out[name] = replace(s, sample_cosine=cosine, worst_sample=row)
    return out


def _logits_setting(cfg: ValidateSettings, meta: EngineMetadata, names: list[str]) -> str | int | None:
    """The class-logit output to hold to top-1 agreement: ``signature.logits_output`` where the user gives it (a
    config, or ``--set``), else the one the engine's run named (``kiln-engine.json``'s ``logits_output``) where the
    reference has it (``names``), so an engine is checked again on its own as its run checked it. A setting given
    as null (``--set signature.logits_output=null``) is the user's too: no output named."""
    if cfg.signature.logits_output is not None or "logits_output" in cfg.signature.model_fields_set:
        return cfg.signature.logits_output
    if meta.logits_output not in names:
        return None
    log.info("class-logit output '%s': the one the engine's run named (signature.logits_output)", meta.logits_output)
    return meta.logits_output


def _refuse_random_graphs(engine_dir: Path, meta: EngineMetadata, reference: Path) -> None:
    """An ONNX ``reference``, and the engine's graph where it is one (ONNX Runtime's), refused where random draws
    reach their outputs (:func:`kiln.core.onnx_io.refuse_random_graph`): ONNX Runtime seeds each session alike, so
    a random engine would pass against its own random graph, and a deterministic one fail against a random
    reference with the gates blamed."""
    graphs = [(reference, f"reference {reference.name}")] if reference.suffix == ".onnx" else []
    engine = engine_dir / meta.files.get("model", "")
    if engine.suffix == ".onnx" and engine.is_file():
        graphs.append((engine, f"engine {engine_dir.name} ({engine.name})"))
    for path, what in graphs:
        hint = f"{RANDOM_HINT}; then export the model again, and build and validate the engine from that graph"
        refuse_random_graph(load_onnx(path, load_external_data=False), what, hint=hint)


def _named_sizes(meta: EngineMetadata, feed: dict[str, np.ndarray]) -> dict[str, int]:
    """The size of each named axis past the batch that ``feed`` holds (``src``, ``tgt``): the shape compared at,
    as the stage records its validated shapes."""
    return {
        dim: int(feed[spec.name].shape[axis])
        for spec in meta.inputs
        if spec.name in feed
        for axis, dim in enumerate(spec.shape)
        if axis and isinstance(dim, str) and axis < feed[spec.name].ndim
    }


COMPARED_BY = "compared by cosine (the whole output's and the worst sample's), max abs error and relative error"


def _say_no_top1(
    ref: dict[str, np.ndarray], setting: str | int | None, logits: str | None, entry: EngineValidation
) -> None:
    """Warn, where no top-1 agreement was computed, why, and what the outputs were compared by: no output is the
    class-logit output (several, none named ``logits``; one named as features) and none is named, or the named one
    has no class axis to agree on. Where no output has a class axis of two entries or more, a regression's values
    (a forecaster's mean and log-variance) are the likelier reading: outputs of one value per row are said to need
    no name ([N, 1] may still be a binary classifier's logit, which naming holds to decision agreement), and where
    no output has even that axis there is nothing to name, said as information only. The default output held to
    nothing is said where it is chosen (:func:`~kiln.stages.accuracy.check.top1_output`); an integer output is held
    to its share of equal values."""
    names = list(ref)
    if entry.top1_agreement is not None or (logits is None and logits_name(names, setting) is not None):
        return
    if logits is not None and ref[logits].dtype.kind != "f":
        return
    widths = [v.shape[class_axis(v.ndim)] for v in ref.values() if v.dtype.kind == "f" and v.ndim >= 2]
    if logits is not None:
        why = f"output '{logits}', which signature.logits_output names, has no class axis (one value per row)"
    elif len(names) == 1 and FEATURE_NAMES.search(names[0]):
        why = f"the only output, '{names[0]}', is named as features"
    else:
        why = f"{len(names)} outputs ({', '.join(names)}), none named '{SINGLE_OUTPUT}'"
    level = logging.WARNING if widths or logits is not None else logging.INFO  # no class axis anywhere: no scores
    log.log(level, "no top-1 agreement: %s; %s (%s)", why, COMPARED_BY, _no_top1_fix(logits, widths))


def _no_top1_fix(logits: str | None, widths: list[int]) -> str:
    """The fix :func:`_say_no_top1` offers: naming an output with a class axis; where every output holds one value
    per row (``widths``: the float outputs' class-axis entries, each 1), a regression's outputs are told that it
    does not apply to them."""
    moot = "this does not apply: nothing to fix"
    if logits is not None:
        return (
            "name an output with a class axis ([N, C] logits, or [N, 1]: one binary logit); for a regression's "
            f"prediction {moot}"
        )
    fix = "--set signature.logits_output=NAME holds the class-logit output to top-1 agreement"
    if widths and max(widths) < 2:  # [N, 1] each: a binary classifier's logit, or a regression's value
        return f"{fix}, a binary classifier's one logit [N, 1] to decision agreement; for a regression's values {moot}"
    return fix


def _say_unvalidated_ranges(meta: EngineMetadata, sizes: list[dict[str, int]]) -> None:
    """Warn of each dynamic axis whose range the engine accepts (``axis_ranges`` of its record) reaches past the
    sizes compared here (``sizes``: each check's): servers and ``infer`` take those sizes, which this command has not
    held to the reference; ``signature.shapes`` set to the range validates at its ends, the inputs resized."""
    wider = {}
    for dim, (low, high) in sorted(meta.axis_ranges.items()):
        seen = sorted({size[dim] for size in sizes if dim in size})
        if seen and (seen[0] > low or seen[-1] < high):
            wider[dim] = (low, high, seen)
    if not wider:
        return
    accepts = ", ".join(f"{d} {lo}..{hi}" for d, (lo, hi, _) in wider.items())
    validated = ", ".join(f"{d} {'/'.join(map(str, seen))}" for d, (_, _, seen) in wider.items())
    ranges = " ".join(f"--set signature.shapes.{d}=[{lo},{hi}]" for d, (lo, hi, _) in wider.items())
    log.warning(
        "the engine accepts %s, validated here only at %s: sizes it serves were not compared with the reference. "
        "Give --inputs at the range's ends, or %s to validate there (the inputs resized)",
        accepts,
        validated,
        ranges,
    )


def _say_padding_ties(
    feed: dict[str, np.ndarray],
    ref: dict[str, np.ndarray],
    axes: dict[str, dict[int, str]],
    out_axes: dict[str, dict[int, str]],
) -> None:
    """Warn of each output whose padding the engine's axis names do not decide (an encoder-decoder's logits as long
    as the source, in an engine that names no axes): it is compared at every position, padding too."""
    for name, tied in padding_ties(feed, ref, axes, out_axes).items():
        log.warning(
            "output '%s' is as long as inputs %s, and the engine's axis names do not say which it follows: its "
            "padding is not left out (every position is compared, padding too)",
            name,
            " and ".join(f"'{t}'" for t in tied),
        )


def _say_new_sizes(meta: EngineMetadata, feed: dict[str, np.ndarray]) -> None:
    """Log that the feed lies outside the sizes the engine's record says it was validated for (its batches or
    axis ranges): servers and ``infer`` refuse them until the engine is validated and packaged at those sizes."""
    shapes = {k: v.shape for k, v in feed.items()}
    off = _off_step(meta, shapes)
    if off:  # the export found the graph takes only sizes on its steps: no pipeline run will serve this one
        log.warning("%s (the export found so); the engine may fail on this size: give sizes it takes", off)
    for outside in filter(None, (meta.outside_batch(shapes), None if off else meta.outside_range(shapes))):
        log.warning(
            "%s; validated here at these sizes, the engine's record still refuses them: add them to "
            "signature.batch_sizes / signature.shapes and run the pipeline to serve them",
            outside,
        )


def _off_step(meta: EngineMetadata, shapes: dict[str, tuple[int, ...]]) -> str | None:
    """The first input axis whose size lies off the steps the engine records for it (``axis_steps``: a U-Net's
    height in steps of 4), said with them; None where every size is on its steps."""
    for spec in meta.inputs:
        shape = shapes.get(spec.name, ())
        for axis, dim in enumerate(spec.shape[: len(shape)]):
            pattern = meta.axis_steps.get(dim) if isinstance(dim, str) else None
            if pattern and not takes_size(pattern, shape[axis]):
                takes = f"the graph takes {dim} only{steps_text(pattern)}"
                return f"input '{spec.name}' axis {axis} ({dim}) is {shape[axis]}: {takes}"
    return None
