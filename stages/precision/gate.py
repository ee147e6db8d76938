"""The precision stage's acceptance of a variant: validation's own check (:mod:`kiln.stages.accuracy.check`) run on
the variant's graph in ONNX Runtime, against the FP32 graph, on the held-out data at every validated shape and
batch size, held to the gates validation will apply to engines of that precision (and its metric's budget).

A variant accepted here is one validation accepts (up to the engine's own numerics), so the fallback aims at the
gate the engine will face, not at a stricter or looser target of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from kiln.core.compare import AGREEMENT_NAMES
from kiln.core.data import Feed
from kiln.core.feeds import fixed_batch
from kiln.core.onnx_io import io_specs, ort_session
from kiln.core.output_names import logits_name
from kiln.core.records import EngineValidation
from kiln.core.timing import MIN_ROUNDS, interleave, median_interval, time_calls
from kiln.stages.accuracy.check import (
    Comparison,
    MissedByShape,
    Reference,
    accuracy_failures,
    compare_on,
    gated_list,
    gates_for,
    merge_worst,
    placed_failure,
    summarize,
)
from kiln.stages.accuracy.config import GatesConfig
from kiln.stages.precision.config import FallbackConfig

Model = onnx.ModelProto | Path


@dataclass
class Verdict:
    """One candidate graph judged: its statistics (the report's columns) and each gate it misses."""

    metrics: dict[str, float | None]
    failures: list[str]
    ref: np.ndarray  # the gated class-logit output (else the first gated) at the data's own shape: FP32's...
    got: np.ndarray  # ...and the candidate's, for choosing the samples the fallback's blame looks at
    # the held-out inputs at the shapes it missed a gate at, where the fallback blames nodes (empty: GateCheck.samples)
    missed: list[Feed] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures


# ONNX Runtime's extended CPU optimizations (ORT_ENABLE_ALL) miscompute FP8 (E4M3) Q/DQ convolutions: the demo
# CNN's FP8 graph gave cosine 0.54 against FP32 with them and 0.998 with the basic level (onnxruntime 1.32).
OPTIMIZATION = {"fp8": "basic"}


def session_runner(model: Model, precision: str | None = None) -> Any:
    """``feed -> outputs by name`` through an ONNX Runtime CPU session of ``model``, at the optimization level
    the graph of ``precision`` is computed right with (:data:`OPTIMIZATION`)."""
    sess = ort_session(model, optimization=OPTIMIZATION.get(precision or "", "all"))
    names = [o.name for o in sess.get_outputs()]

    def run(feed: Feed) -> dict[str, np.ndarray]:
        return dict(zip(names, sess.run(None, feed)))

    return run


class GateCheck:
    """Judges candidate graphs against ``ref`` (the FP32 graph's outputs on the held-out data) with validation's
    comparison and the gates of ``gates`` for the candidate's precision."""

    def __init__(self, fp32: onnx.ModelProto, ref: Reference, gates: GatesConfig, batch_sizes: list[int]) -> None:
        self.fp32, self.ref, self.gates, self.batch_sizes = fp32, ref, gates, sorted(set(batch_sizes))
        self.missed: dict[str, list[dict[str, int]]] = {}  # a failure said with its shape -> the shapes missing it

    @classmethod
    def on_samples(
        cls, fp32: onnx.ModelProto, x: np.ndarray | Feed, logits: int | None = 0, gates: GatesConfig | None = None
    ) -> GateCheck:
        """A check on ``x`` alone (one shape, no labels), for graphs judged outside a pipeline run: in batches of up
        to 64 rows, or of the batch ``fp32`` fixes (its only one; ``x`` then holds whole batches of it)."""
        feed = x if isinstance(x, dict) else {fp32.graph.input[0].name: x}
        names = [o.name for o in fp32.graph.output]
        name = names[logits] if logits is not None and logits < len(names) else None
        batch = fixed_batch(io_specs(fp32)[0]) or min(64, len(next(iter(feed.values()))))
        ref = Reference(session_runner(fp32), [({}, feed)], [None], name, batch)
        return cls(fp32, ref, gates or GatesConfig(), [batch])

    @property
    def samples(self) -> Feed:
        """The held-out inputs at the data's own shape."""
        return self.ref.feed

    def __call__(self, model: Model, precision: str, extra: FallbackConfig | None = None) -> Verdict:
        """``model`` judged as an engine of ``precision``; ``extra``: the fallback's own targets, where set (they
        can only add to the gates). With several validated shapes, each missed gate names the shape it missed at
        (the sizes of the dynamic axes; :meth:`missed_at` gives them back)."""
        run, gates = session_runner(model, precision), gates_for(self.gates, precision, self.ref.logits is None)
        found, missed = Comparison(), []
        for point, feed in self.ref.feeds:  # one shape at a time: the same runs, each shape's gates known too
            part = compare_on(self.ref, run, self.batch_sizes, takes=lambda f, own=feed: f is own)
            missed.append((point, self._failures(part, gates, precision, extra)))
            found.stats = merge_worst(found.stats, part.stats)
            found.accuracy = part.accuracy if part.accuracy is not None else found.accuracy
            found.metric = part.metric if part.metric is not None else found.metric
            found.last = part.last if part.last is not None else found.last
        entry = _entry(found, precision, self.ref.logits, gates)
        failures = self._failures(found, gates, precision, extra)
        if len(self.ref.feeds) > 1:
            failures = [self._placed(f, missed) for f in failures]
        key = _judged_output(self.ref.logits, list(self.ref.outputs[-1]), gates)
        metrics = {
            "top1_agreement": _agreement(entry),
            "agreement": entry.agreement,  # what top1_agreement counted: top-1, or a multi-label head's decisions
            "top1_ties": entry.top1_ties,
            "cosine": entry.cosine,
            "sample_cosine": _worst_sample(entry),
            "max_abs_err": entry.max_abs_err,
            "rel_err": entry.rel_err,
            "accuracy": entry.accuracy,
            "metric": entry.metric,
            "samples": len(self.ref.outputs[-1][key]),
        }
        assert found.last is not None  # the data's own shape is always validated on a graph of any shape
        return Verdict(metrics, failures, self.ref.outputs[-1][key], found.last[key], self.missed_feeds(failures))

    def _failures(
        self, found: Comparison, gates: dict[str, Any], precision: str, extra: FallbackConfig | None
    ) -> list[str]:
        """Each gate ``found`` misses (validation's, then the fallback's own targets)."""
        entry = _entry(found, precision, self.ref.logits, gates)
        fails = accuracy_failures(entry, gates, self.ref.accuracy, self.ref.metric, self.ref.metric_value)
        return fails + _extra_failures(entry, extra)

    def _placed(self, failure: str, missed: MissedByShape) -> str:
        """``failure`` (over every shape) with the shape its value comes from, and the other shapes that miss the
        same gate; remembered for :meth:`missed_at`."""
        placed, points = placed_failure(failure, missed)
        if points:
            self.missed[placed] = points
        return placed

    def missed_at(self, failures: list[str]) -> list[dict[str, int]]:
        """The shapes (sizes of the dynamic axes) the ``failures`` of a verdict were missed at, each once."""
        points: list[dict[str, int]] = []
        for failure in failures:
            points += [p for p in self.missed.get(failure, []) if p not in points]
        return points

    def missed_feeds(self, failures: list[str]) -> list[Feed]:
        """The held-out inputs at each shape the ``failures`` of a verdict were missed at (:meth:`missed_at`), where
        the fallback looks for the nodes to blame: a graph may go wrong at one validated shape only. The last validated
        shape (:attr:`samples`, whose outputs a :class:`Verdict` holds) too where a failure names no shape, and alone
        where none does."""
        points = self.missed_at(failures)
        feeds = [feed for p in points for point, feed in self.ref.feeds if point == p]
        unplaced = any(f not in self.missed for f in failures)
        if (unplaced or not feeds) and not any(f is self.samples for f in feeds):
            feeds.append(self.samples)
        return feeds

    def time_graphs(self, graphs: dict[str, Path], rounds: int = MIN_ROUNDS) -> dict[str, tuple[float, float, float]]:
        """p50 ms and its 95 % interval of each graph in ONNX Runtime on the held-out samples at the largest batch,
        timed in interleaved rounds: the median of the rounds' medians, the statistic the interval is of."""
        feed = {k: v[: max(self.batch_sizes)] for k, v in self.samples.items()}
        timers = {name: _session_timer(session_runner(path), feed) for name, path in graphs.items()}
        out = {}
        for name, per_round in interleave(timers, rounds, 3, budget_s=2.0).items():
            medians = [float(np.median(r)) for r in per_round]
            out[name] = (float(np.median(medians)), *median_interval(medians))
        return out


def _entry(found: Comparison, precision: str, logits: str | None, gates: dict[str, Any]) -> EngineValidation:
    """``found`` as validation's entry for an engine of ``precision`` held to ``gates``, which the gates read: its
    headline values over the outputs the gates hold (``validate.gates.gated_outputs``), as validation's are, so the
    fallback's own targets and its ranking of rounds read the figures validation judges, not an output it leaves
    ungated (a seq2seq model's encoder state). Without :func:`summarize`'s warnings: the entry is a round's graph,
    no engine; validation says them of each engine built from the variant, by its name."""
    entry = EngineValidation(name="", backend="onnxruntime", precision=precision, device="cpu", status="validated")
    entry.gates = gates
    summarize(entry, found.stats, logits, gated_list(gates), warn=False)  # said by validation, per engine
    entry.accuracy, entry.metric = found.accuracy, found.metric
    return entry


def _session_timer(run: Any, feed: Feed) -> Any:
    run(feed)

    def timer(calls: int, budget_s: float | None) -> list[float]:
        return time_calls(lambda: run(feed), calls, cuda=False, budget_s=budget_s, min_calls=1)

    return timer


def _extra_failures(entry: EngineValidation, extra: FallbackConfig | None) -> list[str]:
    """The fallback's own targets (``precision.fallback.min_top1_agreement`` / ``min_cosine``), where set."""
    fails = []
    if extra is None:
        return fails
    if extra.min_top1_agreement is not None and entry.top1_agreement is not None:
        if not entry.top1_agreement >= extra.min_top1_agreement:
            said = AGREEMENT_NAMES["decision"] if entry.agreement == "decision" else "top1_agreement"
            fails.append(f"{said} {entry.top1_agreement:.4f} < fallback target {extra.min_top1_agreement}")
    if extra.min_cosine is not None and entry.cosine is not None and not entry.cosine >= extra.min_cosine:
        fails.append(f"cosine {entry.cosine:.6f} < fallback target {extra.min_cosine}")
    sample = _worst_sample(entry)  # held to the same target, as the gates hold it to min_cosine
    if extra.min_cosine is not None and sample is not None and not sample >= extra.min_cosine:
        fails.append(f"worst-sample cosine {sample:.6f} < fallback target {extra.min_cosine}")
    return fails


def _agreement(entry: EngineValidation) -> float | None:
    """The class logits' top-1 agreement (a multi-label head's: its decision agreement); for a model of integer
    outputs only, their worst share of equal values among the gated outputs: the signal the fallback measures its
    rounds by."""
    if entry.top1_agreement is not None or entry.cosine is not None:
        return entry.top1_agreement
    shares = [o["top1_agreement"] for o in _held(entry).values() if o.get("top1_agreement") is not None]
    return min(shares) if shares else None


def _worst_sample(entry: EngineValidation) -> float | None:
    """The worst sample's cosine over the gated outputs (NaN is worst; None: no such output has one), held like the
    cosine."""
    values = [v for o in _held(entry).values() if (v := o.get("sample_cosine")) is not None]
    return None if not values else float("nan") if np.isnan(values).any() else min(values)


def _judged_output(logits: str | None, outputs: list[str], gates: dict[str, Any]) -> str:
    """The output whose flips the fallback's blame starts from: the class logits where the gates hold them, else the
    first output they hold (``validate.gates.gated_outputs``; every output where unset)."""
    held = gated_list(gates) or outputs
    return logits if logits is not None and logits in held else held[0]


def _held(entry: EngineValidation) -> dict[str, dict[str, float | None]]:
    """The entry's per-output statistics of the outputs its gates hold (:func:`gated_list`; every one where unset)."""
    names = gated_list(entry.gates)
    return {n: o for n, o in (entry.outputs or {}).items() if names is None or n in names}


def logits_index(fp32: onnx.ModelProto, logits_output: str | int | None) -> int | None:
    """Index of the class-logit output among the graph's outputs (None: none)."""
    names = [o.name for o in fp32.graph.output]
    name = logits_name(names, logits_output)
    return names.index(name) if name is not None else None
