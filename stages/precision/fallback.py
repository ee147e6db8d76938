"""Accuracy-driven fallback: build a variant, judge it with validation's check and gates (:mod:`.gate`), and while
it misses them keep the nodes that introduce the most error in FP32 and rebuild — up to ``max_rounds`` times, and
only while the rounds measurably improve on the best before them (while the task metric misses its gate, by closing
a share of its way to it, or of the output's where the metric moves in steps: :func:`improves`). The variant is the
first round that passes (the fewest nodes in float: the fastest), without the nodes of rounds that bought nothing
measurable; when no round passes, the variant is not made, and the result says which nodes were tried and which
gates the best round missed.

A node's blame is how much larger the error of its output is than the error of its inputs (both relative
to the FP32 graph on the same samples): error a node merely passes on is not its fault. When a node already
kept in FP32 still tops the list, the damage arrives through its inputs' rounding (e.g. ``(x + 4096) - 4096``),
so its producers are kept next.

In a quantized graph (INT8, FP8) an op that computes nothing (:data:`CARRIES`: a Relu, a MaxPool, a Reshape) only
carries the values it gets: the Q/DQ pairs around it quantize the tensors of the compute nodes before and after it,
and keeping it alone in float leaves them in place. Its output error is charged to the node that computes its input
(:func:`_owner`); and a round whose graph would be one already judged (keeping its nodes in float changed nothing)
is no round: its nodes are passed over and the next ones picked (:func:`_changing_picks`).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import onnx

from kiln.core.artifacts import hash_file
from kiln.core.text import fmt
from kiln.stages.accuracy.check import COUNT_SLACK, gates_for
from kiln.stages.precision.audit import LAYOUT_OPS
from kiln.stages.precision.compare import Samples, computing_nodes, matching_tensors, take_rows, tensor_errors
from kiln.stages.precision.config import FallbackConfig
from kiln.stages.precision.fp16_select import INDEX_OPS
from kiln.stages.precision.gate import GateCheck, Verdict

log = logging.getLogger("kiln.precision")
BLAME_SAMPLES = 32  # per-tensor comparison holds a chunk's activations for every sample: a few suffice
BLAME_CHUNK = 32  # tensors compared per run: an attention layer's scores take ~50 MB a sample set, a chunk of them GBs
QUANTIZED = ("int8", "fp8")  # precisions whose graphs quantize tensors with Q/DQ pairs
# Ops that compute nothing in a quantized graph: they move, select or clip the values they get, and ONNX Runtime's
# quantizer quantizes one only where its input already is, for the compute nodes around it
CARRIES = LAYOUT_OPS | {"Relu", "Clip", "MaxPool", "GlobalMaxPool", "Slice"}


@dataclass
class FallbackResult:
    path: Path
    kept: dict[str, str] = field(default_factory=dict)
    rounds: list[dict[str, Any]] = field(default_factory=list)
    passed: bool = True
    failures: list[str] = field(default_factory=list)  # the gates the variant misses (empty: it passes)
    tried: list[str] = field(default_factory=list)  # every node a round kept in float, in the order tried
    metrics: dict[str, Any] = field(default_factory=dict)  # the variant's comparison (its round's, or after pruning)
    timing: dict[str, Any] = field(default_factory=dict)  # where two graphs passed: their latencies, the one kept
    enabled: bool = True  # precision.fallback.enabled: off, the variant is its first round's graph

    def summary(self) -> dict[str, Any]:
        return {"passed": self.passed, "rounds": self.rounds, "kept": self.kept, "failures": self.failures}


class Label(str):
    """A fallback's name in its log lines, with the nodes its graph keeps in float before any round (``held``:
    node -> why) and where they come from (``origin``): each round's line counts them with the round's own, so the
    count is what the graph keeps in float beyond the configuration's exclusions."""

    held: dict[str, str]
    origin: str

    def __new__(cls, name: str, held: Mapping[str, str] | None = None, origin: str = "held from the start") -> Label:
        label = super().__new__(cls, name)
        label.held, label.origin = dict(held or {}), origin
        return label


def kept_note(kept: Mapping[str, str], label: str) -> str:
    """``"N nodes kept FP32"`` for a round's graph: the nodes its rounds kept plus those ``label`` holds from the
    start, said apart where there are any."""
    held = label.held if isinstance(label, Label) else {}
    note = f"{len(kept) + len(held)} nodes kept FP32"
    if not held:
        return note
    return f"{note}: {len(held)} {label.origin}" + (f", {len(kept)} by its rounds" if kept else "")


# A round improves on the best before it by MIN_TOP1_GAIN top-1 agreement, or at the same top-1 by MIN_COSINE_GAIN
# cosine; while the task metric misses its gate, by closing MIN_GAP_CLOSED of a way still to go (improves). After
# PATIENCE rounds without (a consumer kept first, its producer next: two rounds) the search stops.
PATIENCE = 2
MIN_TOP1_GAIN = 1e-3  # a round improves by this much top-1 agreement...
MIN_COSINE_GAIN = 1e-5  # ...or, at the same top-1, by this much cosine
MIN_GAP_CLOSED = 0.1  # ...or, while the metric misses its gate, by this share of a way still to go


class MetricGap(NamedTuple):
    """A round's task metric (``validate.metric``) against its gate: its drop from the FP32 graph's value (a
    relative rise for an error metric) and the ``max_metric_drop`` the gate holds it to."""

    name: str
    drop: float
    limit: float
    said: str  # what the drop is called: "relative rise" or "drop"

    @property
    def missed(self) -> bool:
        """Whether the metric misses its gate by a measured (finite) amount: beyond the gate's own slack for
        counted shares (:data:`COUNT_SLACK`), so a metric the gate passes is not one still to close."""
        return bool(np.isfinite(self.drop)) and self.drop > self.limit + COUNT_SLACK


def metric_gap(check: GateCheck, precision: str, metrics: dict[str, float | None]) -> MetricGap | None:
    """The task metric's drop in a round's ``metrics`` and its gate for ``precision`` (None: no metric measured)."""
    value = metrics.get("metric")
    if value is None or check.ref.metric is None or check.ref.metric_value is None:
        return None
    ref = check.ref
    limit = gates_for(check.gates, precision, ref.logits is None)["max_metric_drop"]
    said = "relative rise" if ref.metric.relative else "drop"
    return MetricGap(ref.metric.name, ref.metric.drop(ref.metric_value, value), limit, said)


def improves(
    metrics: dict[str, float | None],
    than: dict[str, float | None],
    gap: MetricGap | None = None,
    gap_before: MetricGap | None = None,
) -> bool:
    """Whether a round's comparison is measurably better than an earlier one's (NaN is worst). Its cosine is the
    one the gate holds to ``min_cosine``: the lower of the whole output's and its worst sample's. Where the earlier
    round misses the task metric's gate (``gap_before``), the round must close :data:`MIN_GAP_CLOSED` of a way still
    to go (:func:`_closes_gap`), not merely gain a little in top-1 or cosine."""
    if gap is not None and gap_before is not None and gap_before.missed:
        return _closes_gap(metrics, than, gap, gap_before)
    top1, before = metrics["top1_agreement"], than["top1_agreement"]
    cos, cos_before = _gated_cosine(metrics), _gated_cosine(than)
    if top1 is not None and before is not None and abs(top1 - before) >= MIN_TOP1_GAIN:
        return top1 > before
    return cos - cos_before >= MIN_COSINE_GAIN


def _closes_gap(
    metrics: dict[str, float | None], than: dict[str, float | None], gap: MetricGap, gap_before: MetricGap
) -> bool:
    """Whether a round closes :data:`MIN_GAP_CLOSED` of the metric's drop beyond its gate, or, where the metric may
    be blind to the round's gain (:func:`_steps`), of top-1 agreement's or the gated cosine's way to 1.

    Why the output's measures count only there: a metric that moves smoothly with the output (a relative L2 on a
    real-valued field) and barely moves while the cosine climbs says the error the rounds remove is not the error
    it sees, and the search stops; a metric that counts decisions (accuracy, F1) stays put until a row flips, then
    jumps, and the rows' margins close as the output's error does, which the cosine's way to 1 measures."""
    if _share_closed(gap_before.drop - gap_before.limit, gap_before.drop - gap.drop):
        return True
    if not _steps(metrics, gap, gap_before):
        return False
    top1, before = metrics["top1_agreement"], than["top1_agreement"]
    if top1 is not None and before is not None and _share_closed(1.0 - before, top1 - before):
        return True
    cos_before = _gated_cosine(than)
    return _share_closed(1.0 - cos_before, _gated_cosine(metrics) - cos_before)


def _steps(metrics: dict[str, float | None], gap: MetricGap, gap_before: MetricGap) -> bool:
    """Whether the task metric may move in steps the round did not reach: the output is class logits (top-1
    measured: its decisions flip row by row), or the metric did not move at all (a count no row changed)."""
    return metrics["top1_agreement"] is not None or gap.drop == gap_before.drop


def _share_closed(way: float, gain: float) -> bool:
    """Whether ``gain`` is at least :data:`MIN_GAP_CLOSED` of ``way``, a way still to go (none left: no)."""
    return bool(way > 0 and gain >= MIN_GAP_CLOSED * way)


def _gated_cosine(metrics: dict[str, float | None]) -> float:
    """The lower of the whole output's cosine and its worst sample's (absent: the whole output's alone)."""
    whole, sample = _finite(metrics["cosine"]), metrics.get("sample_cosine")
    return whole if sample is None else min(whole, _finite(sample))


def _finite(x: float | None) -> float:
    return float(x) if x is not None and np.isfinite(x) else -2.0


# Where each round's start is said while a stage shows progress (round_notes); None: nowhere but the log
_ROUND_NOTE: ContextVar[Callable[[str], None] | None] = ContextVar("fallback_round_note", default=None)


@contextmanager
def round_notes(note: Callable[[str], None]) -> Iterator[None]:
    """Within the block, each fallback round's start is said through ``note`` (the precision stage's progress bar):
    a round judges a graph at every validated shape, minutes for a long input, and otherwise logs only at INFO."""
    token = _ROUND_NOTE.set(note)
    try:
        yield
    finally:
        _ROUND_NOTE.reset(token)


def run_fallback(
    build: Callable[[set[str]], Path],
    check: GateCheck,
    precision: str,
    cfg: FallbackConfig,
    candidates: set[str],
    label: str,
) -> FallbackResult:
    """``build(extra_fp32_nodes) -> model path``, judged by ``check`` as an engine of ``precision``.
    ``candidates``: nodes whose precision ``build`` can change; ``label``: the log lines' name (a :class:`Label`
    where ``build`` keeps nodes in float besides ``extra_fp32_nodes`` and the configuration's exclusions)."""
    kept: dict[str, str] = {}
    result = FallbackResult(path=Path(), enabled=cfg.enabled)
    best: tuple[Verdict, int, dict[str, str], MetricGap | None] | None = None  # verdict, round, nodes kept, metric
    helped: list[bool] = []  # per round after the first: did its nodes improve on the best before them
    added: list[set[str]] = []  # per round after the first: the nodes it kept
    ready: tuple[frozenset[str], Path] | None = None  # the next round's graph, where picking it built it already
    for round_no in range(cfg.max_rounds + 1):
        say = _ROUND_NOTE.get()
        if say is not None:
            say(f"{label}: round {round_no} of at most {cfg.max_rounds} ({len(kept)} nodes kept in float)")
        start = time.perf_counter()
        result.path = ready[1] if ready is not None and ready[0] == set(kept) else build(set(kept))
        verdict = check(result.path, precision, cfg)
        gap = metric_gap(check, precision, verdict.metrics)
        held = {"held": len(label.held)} if isinstance(label, Label) and label.held else {}
        metric = {"metric_gap": gap._asdict()} if gap is not None else {}  # what the precision stage's advice reads
        result.rounds.append(
            {"round": round_no, "kept": len(kept), **held, **verdict.metrics, **metric, "failures": verdict.failures}
        )
        _log_round(label, round_no, cfg.max_rounds, kept, verdict, time.perf_counter() - start)
        better = best is None or improves(verdict.metrics, best[0].metrics, gap, best[3])
        if round_no:
            helped.append(better)
        if better or (verdict.passed and not best[0].passed):
            best = (verdict, round_no, dict(kept), gap)
        if verdict.passed:
            best = (verdict, round_no, dict(kept), gap)
            break
        if not better and _finite(best[0].metrics["cosine"]) > -2.0 and round_no - best[1] >= PATIENCE:
            # these rounds' nodes bought nothing measurable (while outputs overflow, the search goes on)
            result.rounds[-1]["stopped"] = _stalled(
                best[1], round_no, cfg.max_rounds, len(kept) - len(best[2]), best[3]
            )
            log.info("%s: %s", label, result.rounds[-1]["stopped"])
            break
        if not cfg.enabled or round_no == cfg.max_rounds:
            break
        quantized = precision in QUANTIZED
        blamed = time.perf_counter()
        picks, inert, ready = _next_picks(build, check, verdict, result.path, candidates, kept, cfg, quantized, label)
        _log_blame(label, round_no, len(picks), time.perf_counter() - blamed, time.perf_counter() - start)
        if inert:
            result.rounds[-1]["inert"] = inert
        if not picks:
            left = " whose keeping changes the graph" if inert else ""
            log.warning("%s: no node left to keep in FP32%s; the gates are not reachable by fallback", label, left)
            break
        for name, why in picks.items():
            kept[name] = f"fallback round {round_no + 1}: {why}"
        added.append(set(picks))
        result.tried += list(picks)
    assert best is not None
    verdict, at, kept, _ = best
    if at != len(result.rounds) - 1:  # a later round was no better: the best one's graph
        log.info("%s: rounds after %d did not improve on it; the variant is round %d's", label, at, at)
        for entry in result.rounds[at + 1 :]:
            entry["discarded"] = True
    if verdict.passed and at:
        pruned = _prune(build, check, precision, cfg, kept, added[:at], helped[:at], label)
        if pruned is not None:  # two graphs pass: the faster is kept, measured side by side
            result.timing = _faster(build, check, {"as found": (kept, verdict), "pruned": pruned})
            _log_choice(label, precision, sorted(set(kept) - set(pruned[0])), result.timing)
            kept, verdict = pruned if result.timing["kept"] == "pruned" else (kept, verdict)
    result.path = build(set(kept))
    result.kept, result.passed, result.failures = kept, verdict.passed, list(verdict.failures)
    result.metrics = verdict.metrics
    return result


def _next_picks(
    build: Callable[[set[str]], Path],
    check: GateCheck,
    verdict: Verdict,
    path: Path,
    candidates: set[str],
    kept: dict[str, str],
    cfg: FallbackConfig,
    quantized: bool,
    label: str,
) -> tuple[dict[str, str], list[str], tuple[frozenset[str], Path] | None]:
    """The nodes the next round keeps in float, blamed on the round's graph at ``path`` at the shapes its ``verdict``
    missed the gates at (:attr:`Verdict.missed`; its flipped samples first). In a quantized graph, only nodes
    whose keeping changes it: picks that leave it as it was (its file the same) are no round, passed over for the next
    ones (:func:`_changing_picks`). Returns the picks, the nodes passed over, and the graph built for the picks (the
    next round's; None where none was built)."""
    samples = [_informative(x, verdict.ref, verdict.got) for x in verdict.missed or [check.samples]]

    def pick(skip: set[str]) -> dict[str, str]:
        return blame(check.fp32, path, samples, candidates - skip, set(kept), cfg.nodes_per_round, quantized)

    if not quantized:
        return pick(set()), [], None
    return _changing_picks(build, pick, set(kept), hash_file(path), label)


def _changing_picks(
    build: Callable[[set[str]], Path],
    pick: Callable[[set[str]], dict[str, str]],
    kept: set[str],
    digest: str,
    label: str,
) -> tuple[dict[str, str], list[str], tuple[frozenset[str], Path] | None]:
    """``pick(passed_over)``'s nodes whose keeping in float beside ``kept`` changes the graph, whose file's hash is
    ``digest``: a quantized graph quantizes a tensor for every quantized node beside it, so keeping one node in float
    may leave its graph as it was, and judging that again would spend a round on nothing and count it as one that
    did not help. Such picks are passed over and the next ones picked, until a pick changes the graph or none is
    left. Returns the picks, those passed over, and the graph built for the picks."""
    inert: set[str] = set()
    while True:
        picks = pick(inert)
        if not picks:
            return picks, sorted(inert), None
        trial = frozenset(kept | set(picks))
        built = build(set(trial))
        if hash_file(built) != digest:
            return picks, sorted(inert), (trial, built)
        log.info(
            "%s: keeping %s in float leaves the graph as it was (its tensors stay quantized for the nodes around "
            "them): no round for them, the next nodes are picked",
            label,
            ", ".join(sorted(picks)),
        )
        inert |= set(picks)


def _log_round(label: str, round_no: int, rounds: int, kept: dict[str, str], verdict: Verdict, seconds: float) -> None:
    """One round's INFO line: its place among at most ``rounds``, its figures, the nodes kept in float, how long
    building and judging it took, and each gate it misses with the value it got (a round can take minutes)."""
    log.info(
        "%s round %d of at most %d: top-1 agreement %s cosine %s (%s), %.1f s%s",
        label,
        round_no,
        rounds,
        fmt(verdict.metrics["top1_agreement"]),
        fmt(verdict.metrics["cosine"], ".5f"),
        kept_note(kept, label),
        seconds,
        "" if verdict.passed else f": {'; '.join(verdict.failures)}",
    )


def _log_blame(label: str, round_no: int, count: int, seconds: float, round_s: float) -> None:
    """The INFO line of a round's blame (:func:`_next_picks`: per-node errors of both graphs, seconds over large
    activations), which runs after the round's line: its time and the round's in all, so no stretch goes unsaid."""
    log.info(
        "%s round %d: blamed %d node%s in %.1f s (the round took %.1f s in all)",
        *(label, round_no, count, "" if count == 1 else "s", seconds, round_s),
    )


def _stalled(at: int, round_no: int, rounds: int, more: int, gap: MetricGap | None) -> str:
    """Why the search stopped before ``rounds``: rounds ``at + 1`` to ``round_no`` kept ``more`` nodes in float
    without a measured gain over round ``at``; ``gap``: its task metric, where that missed its gate."""
    if gap is not None and gap.missed:
        gain = (
            f"none cut {gap.name}'s {gap.said} ({gap.drop:.4g} at round {at}) by {MIN_GAP_CLOSED:.0%} of its way "
            f"down to max_metric_drop {gap.limit} (nor, where {gap.name} moves in steps, top-1 agreement's or the "
            "cosine's way to 1 by as much)"
        )
    else:
        gain = f"none gained measurably on round {at} in top-1 agreement or cosine"
    return (
        f"the search stopped at round {round_no} of at most {rounds}: rounds {at + 1}-{round_no} kept {more} more "
        f"nodes in float and {gain}; keeping more nodes in float is not helping"
    )


def _faster(
    build: Callable[[set[str]], Path], check: GateCheck, passing: dict[str, tuple[dict[str, str], Verdict]]
) -> dict[str, Any]:
    """Of graphs that pass the gates, the faster in ONNX Runtime on the held-out samples, timed in interleaved rounds
    (a lead within the noise keeps the one with fewer nodes in float, the pruned)."""
    with tempfile.TemporaryDirectory(prefix="kiln-fallback-") as tmp:
        paths = {}
        for name, (kept, _) in passing.items():
            paths[name] = Path(tmp) / f"{name.replace(' ', '_')}.onnx"
            shutil.copyfile(build(set(kept)), paths[name])
        p50 = check.time_graphs(paths)
    ms = {k: round(v[0], 4) for k, v in p50.items()}
    lead = p50["as found"][2] < p50["pruned"][1]  # the one found faster beyond the pruned one's interval
    return {"p50_ms": ms, "kept": "as found" if lead else "pruned"}


def _log_choice(label: str, precision: str, dropped: list[str], timing: dict[str, Any]) -> None:
    """Which of the two passing graphs :func:`_faster` kept: with ``dropped`` back in ``precision`` or in float."""
    found, pruned = timing["p50_ms"]["as found"], timing["p50_ms"]["pruned"]
    if timing["kept"] == "pruned":
        log.info(
            "%s: %s back in %s: the graph runs as fast or faster so (p50 %s ms, vs %s ms with them in float)",
            label,
            dropped,
            precision,
            fmt(pruned, ".3g"),
            fmt(found, ".3g"),
        )
    else:
        log.info(
            "%s: %s stay in float: the graph runs faster so (p50 %s ms, vs %s ms with them in %s)",
            label,
            dropped,
            fmt(found, ".3g"),
            fmt(pruned, ".3g"),
            precision,
        )


def _prune(
    build: Callable[[set[str]], Path],
    check: GateCheck,
    precision: str,
    cfg: FallbackConfig,
    kept: dict[str, str],
    added: list[set[str]],
    helped: list[bool],
    label: str,
) -> tuple[dict[str, str], Verdict] | None:
    """Drop the nodes of rounds that did not measurably improve, where the graph without them still passes: a node
    stays in float only if that helped. ``added[i]``: round i + 1's nodes. None: nothing dropped."""
    dropped: tuple[dict[str, str], Verdict] | None = None
    for round_no, (nodes, good) in enumerate(zip(added, helped), start=1):
        if good:
            continue
        trial = _without(kept, nodes, round_no)
        verdict = check(build(set(trial)), precision, cfg)
        if verdict.passed:
            log.info(
                "%s: the gates pass with %s back in %s too (kept in float, they bought nothing measurable)",
                label,
                sorted(nodes),
                precision,
            )
            kept, dropped = trial, (trial, verdict)
    return dropped


def _without(kept: dict[str, str], nodes: set[str], round_no: int) -> dict[str, str]:
    """``kept`` without ``nodes`` (round ``round_no``'s), its reasons true of the graph without them: a node kept
    for feeding one of them says that one was dropped, not that it is kept FP32."""
    dropped = f"kept FP32 in round {round_no}, dropped when it bought nothing measurable"
    out = {}
    for name, why in kept.items():
        if name not in nodes:
            for gone in nodes:
                why = why.replace(_feeds(gone), _feeds(gone, dropped))
            out[name] = why
    return out


def _feeds(consumer: str, state: str = "kept FP32") -> str:
    """How a node's reason names the FP32 node it was kept for feeding (:func:`blame`)."""
    return f"feeds {consumer} ({state})"


def _informative(x: Samples, ref: np.ndarray, got: np.ndarray) -> Samples:
    """Samples whose prediction flipped first (they show the damage), topped up with the rest. ``ref`` and ``got``
    are the judged output at the last validated shape; ``x`` may hold the same rows at another one, where the rows
    flipped there come first too (rows of another count: the first ones)."""
    rows = len(next(iter(x.values()))) if isinstance(x, dict) else len(x)
    if rows != len(ref):
        return take_rows(x, slice(0, BLAME_SAMPLES))
    flipped = ref.reshape(len(ref), -1).argmax(1) != got.reshape(len(got), -1).argmax(1)
    order = np.concatenate([np.flatnonzero(flipped), np.flatnonzero(~flipped)])
    return take_rows(x, order[:BLAME_SAMPLES])


def blame(
    fp32: onnx.ModelProto,
    model: Path,
    x: Samples | list[Samples],
    candidates: set[str],
    kept: set[str],
    count: int,
    quantized: bool = False,
) -> dict[str, str]:
    """The ``count`` nodes whose output error most exceeds their inputs' error, with a reason each. A tensor is
    compared only with the one the variant computes with the same op (:func:`matching_tensors`): where a quantizer
    fused a Relu into its Conv, the Conv is scored on its own output and the Relu, which has no counterpart, is
    not scored; an input without a counterpart carries the error measured nearest upstream, not none. In a
    ``quantized`` graph an op of :data:`CARRIES` is not scored itself: its output's error is its owner's
    (:func:`_owner`) against that one's inputs, the quantization it carries being that node's. ``x``: the samples,
    or the same samples at several shapes (those a gate was missed at), each tensor's error its worst among them."""
    variant = onnx.load(str(model), load_external_data=False)
    nodes = [n for n in fp32.graph.node if n.op_type not in INDEX_OPS and n.output]
    float_tensors = _float_tensors(fp32)
    names = matching_tensors(fp32, variant)
    tensors = sorted({o for n in nodes for o in n.output if o in float_tensors and o in names})
    shapes = x if isinstance(x, list) else [x]
    err = _worst_errors([tensor_errors(fp32, model, s, tensors, names, chunk=BLAME_CHUNK) for s in shapes])
    carried = _carried_errors(fp32, err, float_tensors)
    fused = _fused_into(fp32, variant)
    producers = {o: n for n in fp32.graph.node for o in n.output}
    picks: dict[str, str] = {}
    for jump, n, out_err, via in _scores(nodes, err, carried, producers, quantized):
        if len(picks) >= count or not jump > 1e-6:
            break
        why = _reason(jump, out_err, sorted(k for k, v in fused.items() if v == n.name), via)
        if n.name in kept:  # the error comes in through its inputs: keep the nodes that produce them
            for i in n.input:
                p = producers.get(i)
                p = _owner(p, producers) if quantized and p is not None and p.op_type in CARRIES else p
                name = fused.get(p.name, p.name) if p is not None else None  # a fused Relu: the Conv it is part of
                op = p.op_type if p is not None else None
                if name in candidates and name not in kept and op not in INDEX_OPS:
                    picks.setdefault(name, f"{_feeds(n.name)} whose {why}")
        elif n.name in candidates:
            picks[n.name] = why
    return picks


Score = tuple[float, onnx.NodeProto, float, onnx.NodeProto | None]  # jump, node, output error, op it is seen after


def _scores(
    nodes: list[onnx.NodeProto],
    err: dict[str, float],
    carried: dict[str, float],
    producers: dict[str, onnx.NodeProto],
    quantized: bool,
) -> list[Score]:
    """Each node's jump (:func:`_jump`) from its inputs' error to its output's, largest first. In a ``quantized``
    graph an op of :data:`CARRIES` scores for its owner (:func:`_owner`), from the owner's inputs to its own output,
    named as the op it is seen after; a node keeps its largest score."""
    best: dict[str, Score] = {}
    for n in nodes:
        if not any(o in err for o in n.output):
            continue  # no counterpart in the variant (fused into another node): its error is that node's
        owner = _owner(n, producers) if quantized and n.op_type in CARRIES else n
        if owner is None:
            continue  # it carries a graph input's quantization, which no node computes
        out_err = max(err[o] for o in n.output if o in err)
        in_err = max((carried.get(i, 0.0) for i in owner.input if i), default=0.0)
        score = (_jump(out_err, in_err), owner, out_err, None if owner is n else n)
        if owner.name not in best or score[0] > best[owner.name][0]:
            best[owner.name] = score
    return sorted(best.values(), key=lambda s: -s[0])


def _owner(node: onnx.NodeProto, producers: dict[str, onnx.NodeProto]) -> onnx.NodeProto | None:
    """The node whose values an op of :data:`CARRIES` carries: the first one up its data input (through other such
    ops) that computes them. Keeping that one in float removes the quantization of its output, which ONNX Runtime's
    quantizer gives the carrying ops only where their input is quantized. None: it carries a graph input or a weight."""
    while node.op_type in CARRIES and node.input and node.input[0] in producers:
        node = producers[node.input[0]]
    return None if node.op_type in CARRIES else node


def _reason(jump: float, out_err: float, fused: list[str], via: onnx.NodeProto | None = None) -> str:
    if not np.isfinite(jump):
        return "first node whose output is not finite (FP16 overflow)"
    within = f"; {', '.join(fused)} fused into it by the quantizer" if fused else ""
    seen = f" at {via.name}'s output (a {via.op_type}, which passes this node's output on)" if via is not None else ""
    return f"output error {out_err:.3g}{seen} vs inputs' {out_err - jump:.3g} (relative L2 vs FP32{within})"


def _worst_errors(errors: list[dict[str, float]]) -> dict[str, float]:
    """Each tensor's worst error over several shapes' measurements: a non-finite one (an overflow) before any."""
    worst: dict[str, float] = {}
    for err in errors:
        for name, value in err.items():
            before = worst.get(name)
            if before is None or (np.isfinite(before) and (not np.isfinite(value) or value > before)):
                worst[name] = value
    return worst


def _carried_errors(fp32: onnx.ModelProto, err: dict[str, float], float_tensors: set[str]) -> dict[str, float]:
    """Each float tensor's error: measured, or where the variant has no counterpart to compare it with, the largest
    its producer's inputs carry (the error measured nearest upstream). Graph inputs and weights carry none."""
    carried: dict[str, float] = {}
    for n in fp32.graph.node:  # graph order: a node's inputs come before it
        upstream = max((carried.get(i, 0.0) for i in n.input if i), default=0.0)
        for o in n.output:
            if o in err:
                carried[o] = err[o]
            elif o in float_tensors:
                carried[o] = upstream
    return carried


def _fused_into(fp32: onnx.ModelProto, variant: onnx.ModelProto) -> dict[str, str]:
    """FP32 node -> the variant's node it was fused into: the variant computes its output with another node of the
    FP32 graph (ONNX Runtime's quantizer gives a Conv the output name of the Relu it absorbs)."""
    ours, theirs = computing_nodes(fp32), computing_nodes(variant)
    names = {n.name for n in fp32.graph.node}
    fused: dict[str, str] = {}
    for tensor, node in ours.items():
        other = theirs.get(tensor)
        if other is not None and other.name != node.name and other.name in names and other.op_type != node.op_type:
            fused[node.name] = other.name
    return fused


def _jump(out_err: float, in_err: float) -> float:
    """Error a node adds. The first node whose output is non-finite gets infinite blame; its consumers none."""
    if not np.isfinite(out_err):
        return float("inf") if np.isfinite(in_err) else 0.0
    return out_err - in_err if np.isfinite(in_err) else 0.0


def _float_tensors(model: onnx.ModelProto) -> set[str]:
    vis = [*model.graph.value_info, *model.graph.output, *model.graph.input]
    return {v.name for v in vis if v.type.tensor_type.elem_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)}
