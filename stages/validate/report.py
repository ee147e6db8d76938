"""The validation section of report.md."""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from kiln.core.compare import AGREEMENT_NAMES
from kiln.core.errors import KilnError
from kiln.core.records import EngineValidation, Memory, ValidationResult
from kiln.core.text import FEATURE_NAMES, fmt
from kiln.core.timing import ratio_interval
from kiln.stages.accuracy.metrics import BUILTINS, DEFAULT, RELATIVE, SPREAD_NAMES, Metric, resolve_metric
from kiln.stages.validate.measured import NO_FINITE_FIX, unmeasured

DEFAULT_LOGITS = "logits"  # the output taken as the class logits by default (kiln.core.outputs, which loads torch)
# how an accuracy_note says signature.logits_output names float targets' prediction, no class logits (validate stage)
NAMED_PREDICTION = "which signature.logits_output names, holds their prediction"
RANDOM_INPUTS = (
    "RANDOM arrays of the declared input shapes, not real data: agreement on them says little about the engine "
    "on real inputs"
)


def inputs_record(inputs: Path | None) -> dict[str, str]:
    """What a validation was fed, for its JSON: the user's ``.npz`` or random arrays, said as such."""
    return {"kind": "file", "path": str(inputs)} if inputs else {"kind": "random", "note": RANDOM_INPUTS}


def direct_report(result: EngineValidation, inputs: Path | None) -> dict[str, Any]:
    """``kiln validate ENGINE --reference ...``'s JSON: what the engine was fed, then its validation. What the class
    logits' agreement counts (``agreement``) is said only beside an agreement measured: a model held to none has no
    kind of it to claim."""
    exclude = {"agreement"} if result.top1_agreement is None else None
    return {"inputs": inputs_record(inputs), **result.model_dump(mode="json", exclude_none=True, exclude=exclude)}


FP32_OFF = (
    "an fp32 engine whose cosine or top-1 agreement misses its reference computes something else on these inputs, "
    "not its precision: compare the PyTorch model with the ONNX file the engine was built from (its kiln-engine.json "
    "source; an export fixes a branch on a size in forward to the size it was exported at), then that file with the "
    "engine (ONNX Runtime's graph optimizations, the torch backend's rewrites)"
)


def gate_failure_hint(
    inputs: Path | None, failures: Sequence[str] = (), precision: str = "", reference: Path | None = None
) -> str:
    """The fix for a failed gate of a direct validation; on random inputs, real ones come first (a reference that
    is no number anywhere on standard normal arrays, a log or square root of negatives, is most likely theirs).
    Where only outputs with nothing measured failed (:func:`~kiln.stages.validate.measured.nothing_measured`: the
    reference itself is no number there), inputs the model takes, which neither the engine's precision nor a gate
    changes. An FP32 engine against a PyTorch ``reference`` has no precision to inspect where its cosine or top-1
    agreement fails (:data:`FP32_OFF`); a tolerance the user tightened past rounding keeps the usual fix."""
    empty = unmeasured(failures)
    relax = "inspect the engine's precision, or relax validate.gates if acceptable"
    if precision == "fp32" and _computes_otherwise(failures) and (reference is None or reference.suffix != ".onnx"):
        relax = FP32_OFF
    if empty:
        relax = NO_FINITE_FIX if len(empty) == len(failures) else f"{NO_FINITE_FIX}; for the other failures, {relax}"
    if inputs is None:
        return f"these were random inputs: validate on real ones with --inputs data.npz (one array per input); {relax}"
    return relax


def _computes_otherwise(failures: Sequence[str]) -> bool:
    """Whether a failure is one rounding does not explain: a cosine or a top-1 agreement below its gate."""
    return any("< min_cosine" in f or "< min_top1_agreement" in f for f in failures)


def report_section(v: ValidationResult, higher_is_better: bool | None = None, random: bool = False) -> list[str]:
    """Validation's part of report.md: the reference, each engine against it, and what failed.
    ``higher_is_better``: ``validate.metric_higher_is_better`` of the run that validated, the direction its gate
    judged ``validate.metric`` by (None: the metric's own); ``random``: the samples are random arrays, not data."""
    b = v.baseline
    sizes = _sizes(v)
    # a model without class logits (float targets) is held to each output's relative error: a column of its own
    rel = any(_rel_limit(e.gates) is not None for e in v.engines)  # a limit set, or derived (rel_err_limit)
    onnx_file = b.backend == "onnxruntime"  # `model.onnx`: the reference is that file, not a PyTorch model
    against = "the input ONNX file" if onnx_file else "PyTorch"
    lines = [
        "",
        f"## Validation against {against}",
        "",
        f"Accuracy reference: {_reference(b)} on the CPU, {_scored(b)} on {b.samples} "
        f"{'random' if random else 'held-out'} samples{_scored_at(b)}. Speedups are against "
        f"{against + ' in ONNX Runtime' if onnx_file else against} on the engine's own device"
        f"{'' if onnx_file else ' (eager; other baselines below)'}.",
        *_compared(v),
        *_narrower(v),
        "",
        "| engine | precision | device | passed | max abs err | "
        + ("rel err | " if rel else "")
        + f"cosine | worst-sample cosine | {_agreement_header(v)} | accuracy | "
        + " | ".join(f"p50 ms @{s}" for s in sizes)
        + f" | speedup @{sizes[-1] if sizes else ''} |",
        "|---|---|---|---|---|---|---|---|---|" + "---|" * (len(sizes) + rel + 1),
    ]
    eager = {x.device: x for x in v.baselines if x.kind == "eager" and x.precision == "fp32"}
    for base in v.baselines or [b]:
        lat = " | ".join(_p50(base.latency_ms, s) for s in sizes)
        ref = eager.get(base.device, base)
        ratio = _baseline_speedup(ref.latency_ms, base.latency_ms, sizes[-1]) if sizes else "-"
        label = "input ONNX file, onnxruntime" if base.backend == "onnxruntime" else f"pytorch {base.kind}"
        lines.append(
            f"| {label} (baseline) | {base.precision} | {base.device} | | | {'| ' if rel else ''}| | | "
            f"{fmt(base.accuracy)} | {lat} | {ratio} |"
        )
    for e in v.engines:
        if e.status != "validated":
            lines.append(
                f"| {e.name} | {_precision(e)} | {e.device} | not run here (targets {e.device.upper()}): "
                f"{e.reason or ''} |" + " |" * (6 + rel + len(sizes))
            )
            continue
        g = e.gates
        lat = " | ".join(_p50(e.latency_ms, s) for s in sizes[:-1])
        last = _gated(_p50(e.latency_ms, sizes[-1]), "≤", g.get("max_latency_p50_ms")) if sizes else ""
        drop = None if g.get("max_accuracy_drop") is None or b.accuracy is None else b.accuracy - g["max_accuracy_drop"]
        ci = e.speedup_ci.get(f"eager-{e.device}", {}).get(sizes[-1]) if sizes else None
        speed = _times(e.speedup_vs_baseline.get(sizes[-1]), ci) if sizes else "-"
        top1_gate = g.get("min_top1_agreement") if e.top1_agreement is not None else None  # none computed: none held
        sample = worst_sample_cosine(e)
        sample_gate = g.get("min_cosine") if sample is not None else None
        lines.append(
            f"| {e.name} | {_precision(e)} | {e.device} | {'yes' if e.passed else '**no**'} | "
            f"{_gated(fmt(e.max_abs_err, '.2e'), '≤', g.get('max_abs_err'))} | "
            + (f"{_gated(fmt(e.rel_err, '.4g'), '≤', _rel_limit(g))} | " if rel else "")
            + f"{_gated(fmt(e.cosine, '.6f'), '≥', g.get('min_cosine'))} | "
            f"{_gated(fmt(sample, '.6f'), '≥', sample_gate)} | "
            f"{_gated(_top1(e), '≥', top1_gate) if e.top1_agreement is not None else _ungated_top1(e)} | "
            f"{_gated(fmt(e.accuracy), '≥', None if drop is None else round(drop, 4))} | "
            f"{lat + ' | ' if lat else ''}{last} | {speed} |"
        )
    if any(e.gates for e in v.engines):
        lines += [
            "",
            "Each value is followed by its gate in parentheses (`validate.gates`, per precision); a value "
            "without one is not gated. Cosine is the whole output's, flattened; the worst sample's is the lowest "
            "of the held-out samples' own (each row of the batch axis, flattened), held to `min_cosine` too; a "
            "sample near zero, whose own cosine is noise, counts the cosine its error would give on a sample of "
            "the median norm where that is higher (`kiln.core.compare.sample_cosines`). Both are the worst "
            "output's" + _of_gated(v) + ".",
        ]
    lines += _decision_note(v)
    tied = [e for e in v.engines if e.top1_ties]
    if tied:
        lines += [
            "",
            "Top-1 flips on ties, counted as agreeing (the reference's margin between the two classes within the "
            "engine's own error on that sample, `kiln.core.compare.TIE_SIGMAS`): "
            + ", ".join(f"{e.name} {e.top1_ties:.2%}" for e in tied)
            + f" of the {_decisions(b)}, at the validated shape and batch size where the share is largest.",
        ]
    lines += _timing(v) + _metric(v, higher_is_better)
    lines += [f"- baseline {x.label} not measured: {x.error}" for x in v.baselines if x.error]
    lines += _per_output(v)
    if v.failures:
        lines += ["", "### Gate failures", ""] + [f"- {f}" for f in v.failures]
        lines += [f"- {e.name}, what to try: {h}" for e in v.engines for h in e.hints]
    return lines + _vs_baselines(v) + _memory(v) + _chosen(v, sizes) + _speed_table(v) + _roofline(v)


def gated_names(e: EngineValidation) -> set[str]:
    """The outputs an engine's gates hold: those ``validate.gates.gated_outputs`` lists (its gates record the list
    where it is set), else every output it was compared on."""
    names = e.gates.get("gated_outputs")
    return set(names) if isinstance(names, list) else set(e.outputs)


def _not_gated(v: ValidationResult) -> list[str]:
    """The outputs compared but held by no gate (left out of ``validate.gates.gated_outputs``), in their order."""
    validated = [e for e in v.engines if e.status == "validated"]
    return list(dict.fromkeys(n for e in validated for n in e.outputs if n not in gated_names(e)))


def _of_gated(v: ValidationResult) -> str:
    """What the headline values are the worst of, where some outputs are not gated: the gated ones'."""
    if not _not_gated(v):
        return ""
    return (
        " among those the gates hold (`validate.gates.gated_outputs`); the outputs marked not gated in the "
        "per-output table are compared and fail no gate"
    )


def _class_logits(e: EngineValidation) -> str | None:
    """The engine's class-logit output: the float output with an agreement (no other keeps one:
    :func:`kiln.stages.accuracy.check.compare_all`); None where it has none."""
    return next(
        (n for n, s in e.outputs.items() if s.get("cosine") is not None and s.get("top1_agreement") is not None), None
    )


def _agreement_header(v: ValidationResult) -> str:
    """The headline column of the class logits' agreement: a multi-label head's is decision agreement."""
    return "decision agree" if any(e.agreement == "decision" for e in v.engines) else "top-1 agree"


def _decision_note(v: ValidationResult) -> list[str]:
    """What decision agreement counts, where a multi-label head's class logits are held to it."""
    if not any(e.agreement == "decision" for e in v.engines):
        return []
    return [
        "",
        "Decision agree: the class logits are a multi-label head's (float multi-hot targets shaped like them), held "
        f"to {AGREEMENT_NAMES['decision']}, the share of (sample, label) pairs whose decision is the reference's, by "
        "`min_top1_agreement`, in place of top-1 agreement (a multi-label head answers by no argmax).",
    ]


def _ungated_top1(e: EngineValidation) -> str:
    """The headline agreement cell of an engine without one: "not gated" where its class logits have one but are
    left out of ``validate.gates.gated_outputs`` (the per-output table shows it), else none."""
    logits = _class_logits(e)
    return "not gated" if logits is not None and logits not in gated_names(e) else fmt(None)


def _top1(e: EngineValidation) -> str:
    """An engine's top-1 agreement, with the share of flips on ties it counts as agreeing where there are any (a
    greedy decoder's flip on a tie is still another token: the headline says it is in the figure)."""
    ties = f" (with {e.top1_ties:.2%} ties)" if e.top1_ties else ""
    return f"{fmt(e.top1_agreement)}{ties}"


def _sizes(v: ValidationResult) -> list[str]:
    sizes: set[str] = {s for x in [v.baseline, *v.baselines] for s in x.latency_ms}
    sizes |= {s for e in v.engines for s in e.latency_ms}
    return sorted(sizes, key=int)


def _times(ratio: float | None, ci: tuple[float, float] | None, unit: str = "") -> str:
    """A speedup with its 95 % interval in parentheses where there is one."""
    if ratio is None:
        return "-"
    return f"{ratio:.2f}{unit}" + (f" ({ci[0]:.2f}-{ci[1]:.2f})" if ci else "")


def _speedup(e: EngineValidation, baseline: str, size: str, unit: str = "") -> str:
    """An engine's speedup over one baseline at one batch size, with its interval."""
    return _times(e.speedups.get(baseline, {}).get(size), e.speedup_ci.get(baseline, {}).get(size), unit)


def _baseline_speedup(ref: dict[str, Any], own: dict[str, Any], size: str) -> str:
    """A baseline's speedup over eager on its device, paired round by round as the engines' are (1.00: eager)."""
    if size not in ref or size not in own:
        return "-"
    if ref is own:
        return "1.00"
    return _times(ref[size].over(own[size]), ratio_interval(ref[size].rounds, own[size].rounds))


def _precision(e: EngineValidation) -> str:
    """The engine's precision as its row names it: a torch engine whose model runs under torch.autocast is said so,
    since the ops autocast keeps in float32 (softmax, norms, reductions) run so."""
    return f"{e.precision} (autocast)" if e.autocast else e.precision


def _p50(latency: dict[str, Any], size: str) -> str:
    """p50 with its 95 % interval where timed in rounds (a busy machine's wide interval is seen, not hidden)."""
    if size not in latency:
        return "-"
    p = latency[size]
    return f"{p.p50:.3f} ({p.ci95[0]:.3g}-{p.ci95[1]:.3g})" if p.ci95 else f"{p.p50:.3f}"


def _timing(v: ValidationResult) -> list[str]:
    """How latency was timed (at which sizes of the dynamic axes besides the batch, where the model has any), and
    whether the machine was too busy for the figures to mean much."""
    t = v.timing
    if not t:
        return []
    line = (
        f"Latency: {t['rounds']} interleaved rounds (engines and baselines in turn); p50 is the median of the "
        "rounds' medians, with its 95 % interval in parentheses. A speedup is the median of the per-round ratios "
        "(baseline / engine, paired round by round), with its 95 % interval: it need not equal the ratio of the two "
        f"p50s. Load average {t['load_before']} → {t['load_after']} on {t['cpus']} CPUs."
    )
    if t.get("torch_threads"):  # PyTorch's threads while timing; ONNX Runtime's CPU engines: one per physical core
        line += f" PyTorch timed on {t['torch_threads']} thread(s)."
    if t.get("timed_at"):  # a model with dynamic axes besides the batch: its latency depends on their sizes too
        line += f" Timed at {_point(t['timed_at'])} (the largest validated sizes), at each batch size."
    if t.get("busy"):
        line += (
            f" **The machine was too busy to time**: intervals {100 * t['median_spread']:.0f} % of p50 wide (median); "
            "differences within them are noise."
        )
    return ["", line]


def _decisions(b: Any) -> str:
    """What a top-1 share counts: the class logits' rows, one per sample, or with labels per position the labelled
    positions (a token's tag, a pixel's class); class logits with positions and no labels count the positions the
    reference is confident at."""
    if b.labelled_positions:
        return "labelled positions compared"
    return (
        "top-1 decisions compared (one per sample; for class logits with positions, one per position the "
        "reference is confident at)"
    )


def _scored(b: Any) -> str:
    """The reference's score as the report's first line says it: its accuracy, or where it has none (float
    targets, a regression) and a metric scored it, that metric (``mse 0.7413``)."""
    if b.accuracy is None and b.metric is not None:
        return f"{b.metric_name or DEFAULT} {metric_text(b.metric)}"
    return f"accuracy {fmt(b.accuracy)}"


def _metric(v: ValidationResult, higher_is_better: bool | None = None) -> list[str]:
    """The metric each engine scored beside the reference's, with its drop and gate, and the unit the gate is in.
    Its name is validate.metric's; a value without one is the metric float targets get where validate.metric is
    unset (:data:`DEFAULT`), whose direction no setting changes. ``higher_is_better``: the configured direction."""
    b = v.baseline
    if b.metric_name is None and b.metric is None:
        return []
    name = b.metric_name or DEFAULT
    default = b.metric_default or not b.metric_name  # a record of before metric_default: a value without a name
    source = "the default for float targets: validate.metric is unset" if default else "validate.metric"
    metric = _resolved(name, b.metric_scale, None if default else higher_is_better)
    scored = [e for e in v.engines if e.metric is not None]
    per = "; ".join(f"{e.name} {metric_text(e.metric)}{_metric_drop(metric, b.metric, e)}" for e in scored)
    if b.labelled_positions == 0:  # labels per position that fit no validated shape (said above)
        per = "not measured: the labels fit no validated size"
    limits = {e.gates.get("max_metric_drop") for e in scored} - {None}
    limit = limits.pop() if len(limits) == 1 else None  # gates per precision that differ: each beside its engine
    gate = _metric_gate(name, metric, b.metric, limit)
    return ["", f"Metric `{name}` ({source}): reference {metric_text(b.metric)}; {per}. {gate}"]


def _resolved(name: str, scale: float | None, higher_is_better: bool | None = None) -> Metric | None:
    """The metric ``name`` as validation judged it, with the scale its relative drop was over and the direction
    ``validate.metric_higher_is_better`` set (None: its own): a built-in, or a user's function whose module this
    process imported already (the run that validated); None for a user's metric that a cached run reads from its
    record, which runs none of the user's code."""
    module = name.partition(":")[0]
    if name not in BUILTINS and module not in sys.modules:
        return None
    try:
        metric = resolve_metric(name, None, higher_is_better)
    except KilnError:  # the module no longer holds the function: said as unknown, not as an error of the report
        return None
    return None if metric is None else replace(metric, scale=scale)


def _metric_gate(name: str, metric: Metric | None, baseline: float | None, limit: float | None) -> str:
    """What ``validate.gates.max_metric_drop`` (``limit`` where every engine has the same) holds the metric to, in
    the unit :meth:`Metric.drop` takes it in: a drop in the metric's own units, or an error metric's rise over the
    targets' spread or over the reference's value; for a user's metric not known here, both, as its function
    decides."""
    at_most = "at most the gate" if limit is None else f"at most {limit:g}"
    share = "the gate's share" if limit is None else f"{100 * limit:g} %"
    if metric is None:
        return (
            f"Gate (`max_metric_drop`): a drop of {at_most} in `{name}`'s own units, or, where its function sets "
            f"`relative = True`, {share} worse than the reference's value."
        )
    worse = "drop" if metric.higher_is_better else "rise"
    direction = f"{'higher' if metric.higher_is_better else 'lower'} is better"
    if not metric.relative or not (metric.scale or baseline):
        return f"Gate (`max_metric_drop`): a {worse} of {at_most} in `{name}`'s own units ({direction})."
    what = "an error metric" if not metric.higher_is_better else "judged relatively"
    diff = "(reference - engine)" if metric.higher_is_better else "(engine - reference)"
    if metric.worse_than_mean(baseline):  # over the reference's own error, which exceeds the spread
        spread = SPREAD_NAMES.get(name, "spread")
        return (
            f"Gate (`max_metric_drop`): a {worse} of {at_most} times the reference's value, {diff} / reference: its "
            f"`{name}` exceeds the targets' {spread} ({metric.scale:.4g}), so it predicts worse than their mean and "
            f"the gate says little about the task; `{name}` is {what} ({direction})."
        )
    if metric.scale:
        r2 = "" if name != "mse" or limit is None else f": at most {limit:g} of R^2 lost"
        return (
            f"Gate (`max_metric_drop`): a {worse} of {at_most} times the targets' spread in its units "
            f"({metric.scale:.4g}), {diff} / spread{r2}; `{name}` is {what} ({direction})."
        )
    more = "more error" if not metric.higher_is_better else "lower"
    return (
        f"Gate (`max_metric_drop`): a {worse} of {at_most} times the reference's value, {diff} / reference: "
        f"{share} {more} than the reference's; `{name}` is {what} ({direction})."
    )


def _metric_drop(metric: Metric | None, baseline: float | None, e: EngineValidation) -> str:
    """`` (relative rise 0.02, gate ≤ 0.01)``: the metric's drop from the reference (an error metric's rise over
    the targets' spread, else over the reference's value: :meth:`kiln.stages.accuracy.metrics.Metric.drop`) beside
    its gate; the gate alone for a metric whose direction is not known here (:func:`_resolved`)."""
    limit = e.gates.get("max_metric_drop")
    gate = "" if limit is None else f"gate ≤ {limit:g}"
    if metric is None or baseline is None or e.metric is None:
        return f" ({gate})" if gate else ""
    relative = metric.relative and (metric.scale or baseline != 0)
    worse = "drop" if metric.higher_is_better else "rise"
    what = f"relative {worse}" if relative else worse
    return f" ({what} {metric_text(metric.drop(baseline, e.metric))}{', ' + gate if gate else ''})"


def metric_text(value: float | None) -> str:
    """A metric's value or drop for report.md: four significant digits, always with a decimal point or an exponent
    (``1.0``, ``24.9``, ``1.1e+06``), so that a float is not read as a whole number or a count; ``-`` when absent."""
    said = fmt(value, ".4g")
    return said if value is None or any(c in said for c in ".en") else f"{said}.0"  # "n": nan and inf


def _vs_baselines(v: ValidationResult) -> list[str]:
    """Every engine's speedup against every baseline on its device, per batch size."""
    rows = [e for e in v.engines if e.speedups]
    if not rows or sum(1 for b in v.baselines if b.latency_ms) < 2:
        return []
    out = [
        "",
        "### Speedup against each PyTorch baseline (same device; median of paired per-round ratios)",
        "",
        "| engine | " + " | ".join(sorted({k for e in rows for k in e.speedups})) + " |",
        "|---|" + "---|" * len({k for e in rows for k in e.speedups}),
    ]
    for e in rows:
        cells = [
            ", ".join(f"{_speedup(e, k, bs, 'x')} @{bs}" for bs in e.speedups.get(k, {})) or "-"
            for k in sorted({k for r in rows for k in r.speedups})
        ]
        out.append(f"| {e.name} | " + " | ".join(cells) + " |")
    return out


def _memory(v: ValidationResult) -> list[str]:
    entries: list[tuple[str, Memory]] = [(f"pytorch {b.label}", b.memory) for b in v.baselines if b.memory]
    entries += [(e.name, e.memory) for e in v.engines if e.memory]
    if not entries:
        return []
    out = [
        "",
        "### Memory",
        "",
        "| what | peak MB (load + largest batch) | size on disk MB | measured as |",
        "|---|---|---|---|",
    ]
    for name, m in entries:
        peak = "not measured" if m.peak_mb is None else fmt(m.peak_mb, ".3g")
        out.append(f"| {name} | {peak} | {fmt((m.size_bytes or 0) / 1e6, '.2f')} | {m.method} |")
    return out + ["", "PyTorch's size is its weights in memory (parameters + buffers); an engine's is its folder."]


def _chosen(v: ValidationResult, sizes: list[str]) -> list[str]:
    """Per batch size: every candidate's p50 and the one chosen (fastest passing its gates)."""
    cands: list[EngineValidation] = [e for e in v.engines if e.status == "validated"]
    if not cands:
        return []
    out = ["", "### Chosen engine per batch size", "", "| batch | chosen | candidates (p50 ms) |", "|---|---|---|"]
    for s in sizes:
        listed = ", ".join(
            f"{e.name} {_p50(e.latency_ms, s)}" + ("" if e.passed and not e.dropped else " (no)")
            for e in sorted(cands, key=lambda e: e.latency_ms[s].p50 if s in e.latency_ms else 1e30)
        )
        out.append(f"| {s} | {v.chosen.get(s, 'none passed')} | {listed} |")
    return out + [f"- batch {bs}: {note}" for bs, note in v.choice_notes.items()]


def _gated(value: str, op: str, limit: float | None) -> str:
    return value if limit is None else f"{value} ({op} {limit:g})"


def worst_sample_cosine(e: EngineValidation) -> float | None:
    """The lowest worst-sample cosine over the outputs the engine's gates hold (:func:`gated_names`), as its other
    headline values are (NaN is lowest; None: no such output has one)."""
    held = gated_names(e)
    values = [v for n, s in e.outputs.items() if n in held and (v := s.get("sample_cosine")) is not None]
    if not values:
        return None
    return float("nan") if any(math.isnan(v) for v in values) else min(values)


def _scored_at(b: Any) -> str:
    """Where a model with dynamic axes was scored: the sizes of its inputs there (``seq=128``)."""
    at = getattr(b, "scored_at", None)
    return f" at {_point(dict(sorted(at.items())))}" if at and b.accuracy is not None else ""


def _point(sizes: dict[str, int]) -> str:
    """Dynamic axis sizes as the report says them: ``seq=128, h=64``."""
    return ", ".join(f"{k}={n}" for k, n in sizes.items())


def _reference(b: Any) -> str:
    return "ONNX Runtime FP32 (the input ONNX file)" if b.backend == "onnxruntime" else "PyTorch FP32 eager"


UNSCORED = (
    "**task accuracy not measured, and `max_accuracy_drop` (and `max_metric_drop`) not applied**: the held-out "
    "labels are per position at the data's own sizes, which lie outside the validated sizes (the engines are built "
    "for those alone), and labels at other sizes would label other positions; add the data's sizes to "
    "`signature.shapes` to measure it"
)
# the same without class logits (float targets that follow an output's size, an image-to-image model's): no task
# accuracy to measure, only the metric
UNSCORED_METRIC = (
    "**the task metric not measured, and `max_metric_drop` not applied**: the held-out targets are per position at "
    "the data's own sizes, which lie outside the validated sizes (the engines are built for those alone); add the "
    "data's sizes to `signature.shapes` to measure it"
)


def _compared(v: ValidationResult) -> list[str]:
    """What the engines were compared on: every output, the logits one (if any) for top-1 and accuracy, each said
    only where it was measured."""
    b = v.baseline
    if not b.compared:
        return []
    shapes = "; ".join(_point(p) for p in b.shapes)
    logits = _measured_on_logits(v) if b.logits_output else _without_class_logits(b)
    if b.labelled_positions == 0:  # labels per position that fit no validated shape
        logits = f"top-1 agreement on '{b.logits_output}' (every position); {UNSCORED}" if b.logits_output else ""
        logits = logits or UNSCORED_METRIC
    elif b.logits_output and b.labelled_positions is not None:  # a tag per token / a class per pixel
        logits += (
            f", counted over the {b.labelled_positions:,} labelled positions of the held-out samples (labels "
            "per position; -100 marks one without)"
        )
    ungated = _not_gated(v)
    free = f"; not gated: {', '.join(ungated)} (`validate.gates.gated_outputs`)" if ungated else ""
    return [
        "",
        f"Compared outputs: {', '.join(b.compared)} (error and cosine per output, the worst gated{free}); {logits}."
        + _equal_values_note(v)
        + _scalar_note(v)
        + (f" Dynamic axes validated at: {shapes}{_padded(b)}." if shapes else "")
        + _coupled(v),
    ]


def equal_value_outputs(v: ValidationResult) -> list[str]:
    """The outputs compared value for value (integer class ids, flags: no cosine, a share of equal values kept in
    the agreement's place, :func:`kiln.stages.accuracy.check.compare_all`), in their order."""
    validated = [e for e in v.engines if e.status == "validated"]
    return [
        n
        for n in v.baseline.compared
        if any(
            e.outputs.get(n, {}).get("cosine", 0) is None and e.outputs[n].get("top1_agreement") is not None
            for e in validated
        )
    ]


def _equal_values_note(v: ValidationResult) -> str:
    """The gate of the integer outputs (class ids, flags), which the summary table has no column for: the share of
    their values equal to the reference's, held to ``min_top1_agreement``, in place of a cosine."""
    names = equal_value_outputs(v)
    if not names:
        return ""
    one = len(names) == 1
    return (
        f" {', '.join(repr(n) for n in names)} hold{'s' if one else ''} integers (class ids, flags): held to the "
        f"share of {'its' if one else 'their'} values equal to the reference's (`min_top1_agreement`) in place of a "
        "cosine, which the table leaves empty."
    )


def scalar_outputs(v: ValidationResult) -> list[str]:
    """The outputs without a batch axis (a 0-D loss: one value a call), which have neither a cosine nor a share of
    equal values (:func:`kiln.core.compare.compare_arrays`'s ``whole``), in their order."""
    validated = [e for e in v.engines if e.status == "validated"]
    return [
        n
        for n in v.baseline.compared
        if any(
            n in e.outputs and e.outputs[n].get("cosine") is None and e.outputs[n].get("top1_agreement") is None
            for e in validated
        )
    ]


def _scalar_note(v: ValidationResult) -> str:
    """How the outputs without a batch axis are held, where the table leaves their cosine empty: the cosine of one
    value is its sign, and with no samples to vary between their relative error is over their norm."""
    names = scalar_outputs(v)
    if not names:
        return ""
    one = len(names) == 1
    return (
        f" {', '.join(repr(n) for n in names)} ha{'s' if one else 've'} no batch axis (one value a call): held to "
        f"{'its' if one else 'their'} relative error over {'its' if one else 'their'} norm, with no cosine (that of "
        "one value is its sign), which the table leaves empty."
    )


def _without_class_logits(b: Any) -> str:
    """What was measured where no output is the class logits: why none is (:func:`_no_class_logits`), and why there
    is no task accuracy (``accuracy_note``: no labels, float targets), each said where it is another reason."""
    if len(b.compared) == 1 and FEATURE_NAMES.search(b.compared[0]) and b.metric_name not in RELATIVE:
        return (  # one reason, not the default's rule for class logits beside the features' note
            f"no class-logit output: '{b.compared[0]}' is named as features (an embedding), held to cosine (the "
            "whole output's and its worst sample's), max abs error and relative error; no top-1 agreement or task "
            "accuracy"
        )
    why, note = _no_class_logits(b), b.accuracy_note
    said = f"no class-logit output ({why}): no top-1 agreement"
    if note is None or note == why:
        return f"{said} or accuracy, and each output's relative error gated"
    return f"{said}, and each output's relative error gated; no task accuracy ({note})"


def _no_class_logits(b: Any) -> str:
    """Why no output was taken as the class logits, with the setting that names one: float targets scored by an
    error metric, or an output ``signature.logits_output`` names beside float targets (:data:`NAMED_PREDICTION`), are
    a regression's values (``accuracy_note`` says so); several outputs, none named ``logits``, leave
    none by default; else the output that is the default was not held as class logits, which it is only beside
    integer labels (or ``num_classes`` without labels) and a class axis ``num_classes`` wide, as one logit per
    row (``[N, 1]`` or ``[N]``) in a two-class task (:func:`kiln.stages.accuracy.check.top1_output`), or as the
    class scores beside detection labels (:func:`kiln.core.output_names.detection_scores`)."""
    names, metric = b.compared, b.metric_name or (DEFAULT if b.metric is not None else None)
    if b.accuracy_note and (metric in RELATIVE or NAMED_PREDICTION in b.accuracy_note):
        return b.accuracy_note
    default = names[0] if len(names) == 1 else DEFAULT_LOGITS if DEFAULT_LOGITS in names else None
    if default is None:
        return (
            f"{len(names)} outputs ({', '.join(names)}), none named '{DEFAULT_LOGITS}': set "
            "`signature.logits_output` to the one that holds class logits"
        )
    return (
        f"output '{default}' is taken as class logits by default only beside integer labels (or num_classes without "
        "labels) with a class axis num_classes wide, as one logit per row ([N, 1] or [N]) beside 0/1 labels with "
        "num_classes=2, or beside detection labels (float [N, M, 5]) where the outputs' names alone tell the class "
        "scores (a DETR-style head's no-object class included) from the boxes: set "
        f"`signature.logits_output: {default}` if it holds class logits"
    )


def _coupled(v: ValidationResult) -> str:
    """Outputs whose rows depend, or may depend, on the whole batch, served unbatched (the Triton configs'
    max_batch_size 0), said with why: the runtime probe saw them follow the batch (a two-tower model's image-text
    logits ``[batch, batch]``), compared on whole batches then, or the graph selects over the batch
    (:func:`kiln.stages.validate.coupling.rows_may_mix`), which the probe's rows may not show. The record does not
    say which of the two flagged an output: the stage's warning names those the graph alone flagged."""
    if not v.batch_coupled:
        return ""
    names = ", ".join(f"'{n}'" for n in v.batch_coupled)
    one = len(v.batch_coupled) == 1
    return (
        f" {names} depend{'s' if one else ''} on the whole batch, or may: the runtime probe saw "
        f"{'its' if one else 'their'} rows follow the batch (then compared on whole batches), or the graph selects "
        "over the batch (NonZero, Compress or Unique on batched values), which held-out data of one kind need not "
        "show; served unbatched (no server batches requests together)."
    )


# Why a named class-logit output of one value per row got no top-1 agreement: only a two-class task's is one logit
ONE_VALUE_PER_ROW = (
    "it has no class axis: one value per row, which is a binary classifier's one logit only beside 0/1 labels with "
    "num_classes=2 in the data"
)


def _measured_on_logits(v: ValidationResult) -> str:
    """What was measured on the class-logit output: top-1 agreement, a multi-label head's decision agreement
    (where an engine gave one, gated or not) and task accuracy (where the reference has one), and why each that was
    not, was not."""
    b = v.baseline
    validated = [e for e in v.engines if e.status == "validated"]
    top1 = any(e.top1_agreement is not None or _class_logits(e) is not None for e in validated)
    agreement = AGREEMENT_NAMES[next((e.agreement for e in validated if e.agreement != "top1"), "top1")]
    measured = [what for what, done in ((agreement, top1), ("accuracy", b.accuracy is not None)) if done]
    missing = []
    if not top1:
        why = "no engine was validated here" if not validated else ONE_VALUE_PER_ROW
        if b.logits_output in equal_value_outputs(v):
            why = "it holds integers, no class scores"
        missing.append(f"no top-1 agreement ({why})")
    if b.accuracy is None:
        missing.append(f"no task accuracy ({b.accuracy_note or 'no labels fit it'})")
    said = f"{' and '.join(measured)} on '{b.logits_output}'" if measured else f"class-logit output '{b.logits_output}'"
    return "; ".join([said, *missing]) if measured else f"{said}: {' and '.join(missing)}"


def _padded(b: Any) -> str:
    """How the held-out inputs were made at validated sizes other than the data's own (``own_sizes``; a record of
    before them: where accuracy was measured),
    which the gates judge too: past it they are lengthened (their values repeated along the axis: token ids with
    their mask; float copies shifted slightly, :func:`kiln.core.shapes.copy_step`); below it they are cut, keeping
    their first positions (the last where rows are padded on the left), so a smaller size sees only the start of
    each sample: a cloud's first points, a sorted one's bottom slice."""
    own = getattr(b, "own_sizes", None) or getattr(b, "scored_at", None) or {}
    past = [p for p in b.shapes if any(p.get(k, 0) > v for k, v in own.items())]
    below = [p for p in b.shapes if any(k in p and p[k] < v for k, v in own.items())]
    data = _point(dict(sorted(own.items())))
    said = []
    if past:
        said.append(
            f"at {'; '.join(_point(p) for p in past)} the held-out inputs are lengthened past the data's own {data}: "
            "their values repeated along the axis, each copy of a float input shifted by a fraction of its spread so "
            "that no score ties"
        )
    if below:
        said.append(
            f"at {'; '.join(_point(p) for p in below)} {'they' if past else 'the held-out inputs'} are cut short of "
            f"the data's own {data} by keeping their first positions along the axis (the last where rows are padded "
            "on the left), so that size sees only the start of each sample"
        )
    return f" ({'; '.join(said)})" if said else ""


def _narrower(v: ValidationResult) -> list[str]:
    """Engines validated at fewer of the shapes than the reference (a torch engine that takes one length only):
    said, so that the shapes above are not read as every engine's."""
    every = len(v.baseline.shapes)
    narrow = [e for e in v.engines if e.status == "validated" and every and len(e.shapes) < every]
    return [
        f"{e.name} takes fewer sizes and was validated at "
        + ("; ".join(_point(p) for p in e.shapes) or "its own shape only")
        + " (requests of other sizes are refused)."
        for e in narrow
    ]


def _per_output(v: ValidationResult) -> list[str]:
    """Each output's worst statistics per engine, when the model has more than one output; those no gate holds
    (left out of ``validate.gates.gated_outputs``) marked not gated, the class logits' decision agreement and an
    integer output's share of equal values (no cosine: top-k indices, a predicted class) marked as such, since
    the top-1 column holds them."""
    rows = [
        (e, name, s)
        for e in v.engines
        if e.status == "validated" and len(e.outputs) > 1
        for name, s in e.outputs.items()
    ]
    if not rows:
        return []
    out = [
        "",
        "### Per output (worst over shapes and batch sizes)",
        "",
        "| engine | output | max abs err | rel err | cosine | worst-sample cosine | top-1 agree |",
        "|---|---|---|---|---|---|---|",
    ]
    for e, name, s in rows:
        held = "" if name in gated_names(e) else " (not gated)"
        decision = " (decision)" if e.agreement == "decision" and name == _class_logits(e) else ""
        decision = " (equal values)" if s["cosine"] is None and s["top1_agreement"] is not None else decision
        out.append(
            f"| {e.name} | {name}{held} | {fmt(s['max_abs_err'], '.2e')} | {fmt(s['rel_err'], '.2e')} | "
            f"{fmt(s['cosine'], '.6f')} | {fmt(s.get('sample_cosine'), '.6f')} | "
            f"{fmt(s['top1_agreement'])}{decision} |"
        )
    return out


def _speed_table(v: ValidationResult) -> list[str]:
    """INT8/FP16 p50 speedup over the FP32 (and FP16) engine of the same backend and device, per batch size."""
    if not v.speed_vs_fp32:
        return []
    engines = {e.name: e for e in v.engines}
    out = [
        "",
        "### Reduced precision vs FP32 and FP16, same backend and device",
        "",
        "| engine | vs FP32 (speedup per batch, paired) | INT8/FP8 vs FP16 | verdict |",
        "|---|---|---|---|",
    ]
    for r in v.speed_vs_fp32:
        ratios = _per_batch(r["vs_fp32"], r.get("vs_fp32_ci", {}))
        fp16 = _per_batch(r.get("vs_fp16", {}), r.get("vs_fp16_ci", {}))
        dropped = engines[r["engine"]].dropped if r["engine"] in engines else None
        judged = r[f"vs_{r.get('judged_against', 'fp32')}"]
        verdict = "faster" if judged.get(r["largest_batch"], 0) >= 1 else "not faster"
        verdict = "within the timing's noise" if r.get("within_noise") else verdict
        slower = f"**slower than {r.get('judged_against', 'fp32').upper()}**"
        verdict = f"**dropped**: {dropped}" if dropped else (slower if r["slower"] else verdict)
        out.append(f"| {r['engine']} | {ratios} | {fp16} | {verdict} |")
    return out


def _per_batch(ratios: dict[str, float], cis: dict[str, Any]) -> str:
    """``2.10x (1.90-2.30) @1, 3.00x @32``: a speedup per batch size, each with its interval where there is one."""
    return ", ".join(f"{_times(x, cis.get(bs), 'x')} @{bs}" for bs, x in ratios.items()) or "-"


def _peak(p: dict[str, Any]) -> str:
    measured = "measured " + ", ".join(f"{k} {x:g}" for k, x in p.get("measured", {}).items())
    sheet = ", ".join(f"{k} {x:g}" for k, x in p.get("datasheet", {}).items())
    return measured + (f" (datasheet {sheet})" if sheet else "")


def at_least(row: dict[str, Any]) -> str:
    """ "≥ " before a roofline row's figures where its FLOPs leave out compute nodes the audit could not count."""
    return "≥ " if row.get("flops_lower_bound") else ""


def _rel_limit(gates: dict[str, Any]) -> float | None:
    """The relative-error limit an engine was held to: ``max_rel_err`` where set, else the one derived for it
    (``rel_err_limit``, recorded by :func:`kiln.stages.accuracy.check.summarize`; None: none held)."""
    limit = gates.get("max_rel_err")
    return limit if limit is not None else gates.get("rel_err_limit")


def _share_of_peak(row: dict[str, Any]) -> str:
    """An engine's share of the measured peak; "> 100" where it outran the peak, which was measured low."""
    return "> 100" if row.get("above_measured_peak") else fmt(row["pct_of_measured_peak"], ".1f")


def _precision_share(e: EngineValidation) -> str:
    """``int8 100%``: the engine's share of FLOPs per precision; where its roofline rows record compute nodes the
    audit could not count (:func:`kiln.stages.validate.stage.uncounted_share`), each share it leaves unsure as its
    floor, ``int8 ≥ 50% (100% of the counted FLOPs); uncounted: Einsum x1``."""
    row = next(iter(e.roofline.values()), {})
    floor, ops = row.get("share_floor") or {}, row.get("uncounted_ops") or {}
    said = [
        f"{k} ≥ {floor[k]:.0%} ({x:.0%} of the counted FLOPs)"
        if f"{floor.get(k, x):.0%}" != f"{x:.0%}"
        else f"{k} {x:.0%}"
        for k, x in e.precision_share.items()
    ]
    if not said:
        return "-"
    uncounted = ", ".join(f"{op} x{sum(by.values())}" for op, by in ops.items())
    return ", ".join(said) + (f"; uncounted: {uncounted}" if uncounted else "")


def _roofline(v: ValidationResult) -> list[str]:
    """Achieved TFLOP/s per engine and batch beside the device's measured GEMM peak (and the datasheet's)."""
    rows = [e for e in v.engines if e.roofline]
    if not rows:
        return []
    peaks = "; ".join(
        f"{dev}: {p['device']}, measured "
        + ", ".join(f"{k} {x:g}" for k, x in p.get("measured", {}).items())
        + (
            " (while other work ran: a floor of its peak, measured again when validation next runs)"
            if p.get("busy")
            else ""
        )
        + (
            " (datasheet " + ", ".join(f"{k} {x:g}" for k, x in p["datasheet"].items()) + ")"
            if p.get("datasheet")
            else ""
        )
        for dev, p in v.peaks.items()
    )
    out = [
        "",
        "### Roofline",
        "",
        f"Peak TFLOP/s of a large GEMM here: {peaks}. FLOPs per sample from each engine's graph (its audit, "
        "which also gives the share of them computed in each precision; a share after ≥ is its floor, where compute "
        "nodes the audit could not count, named beside it, may run in another precision).",
        "",
        "| engine | precision share | GFLOP/sample | batch | TFLOP/s at p50 | % of measured peak | % of datasheet |",
        "|---|---|---|---|---|---|---|",
    ]
    for e in rows:
        share = _precision_share(e)
        for bs, r in sorted(e.roofline.items(), key=lambda kv: int(kv[0])):
            out.append(
                f"| {e.name} | {share} | {at_least(r)}{(e.flops_per_sample or 0) / 1e9:.3g} | {bs} | "
                f"{at_least(r)}{r['tflops']:.3g} | "
                f"{_share_of_peak(r)} ({r['peak']}) | {fmt(r['pct_of_datasheet'], '.1f')} |"
            )
    return out
