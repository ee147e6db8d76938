"""Build-time autotuning of ONNX Runtime engines, like TensorRT's tactic selection: on the target machine, time a
small set of candidate session settings per optimization batch size and keep the fastest one whose outputs still
agree with the FP32 reference. Every trial and the choice go into ``kiln-engine.json`` (``autotune``); the runner
opens each shape with the choice recorded for its batch (``onnxruntime_runner.chosen_knobs``).

A candidate is a dict of knob values (``onnxruntime_runner.KNOBS``: cuDNN search, NHWC, workspace, CUDA graph,
transformer fusion, CPU threads...). ONNX Runtime has no autotuner of its own across these session-level settings
(cuDNN's EXHAUSTIVE search only picks kernels inside one setting), hence this module.

Search: ``greedy`` starts from the configured settings and varies one knob at a time, keeping the best so far
(ORT's knobs interact little, and this keeps the candidate count at 1 + sum(values - 1)); ``grid`` tries every
combination. A time budget bounds the whole search; what it cut is recorded.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from kiln.core.compare import compare_outputs, worst
from kiln.core.errors import ConfigError
from kiln.core.inputs import random_inputs
from kiln.core.onnx_io import ort_session
from kiln.core.text import ort_reason
from kiln.core.timing import time_calls
from kiln.stages.engines.onnxruntime.config import OrtAutotuneConfig
from kiln.stages.engines.onnxruntime.runner import (
    KNOBS,
    cuda_slot,
    load_slot,
    open_session,
    plan_for,
    session_options,
)

log = logging.getLogger("kiln.build")
Measure = Callable[[dict[str, Any]], dict[str, Any]]
Timer = Callable[[Callable[[], Any], int], list[float]]


AUTOTUNE_SHAPES_HINT = (
    "autotuning times fixed shapes: export with only the batch axis dynamic, or set "
    "build.onnxruntime.autotune.cuda/cpu: false"
)


# ----------------------------------------------------------------------------------------------- search / choice
def better(trial: dict[str, Any], best: dict[str, Any] | None) -> bool:
    """Agreeing beats not agreeing; among equals, the lower median wins."""
    if trial.get("median_ms") is None:
        return False
    if best is None or best.get("median_ms") is None:
        return True
    if trial["agrees"] != best["agrees"]:
        return trial["agrees"]
    return trial["median_ms"] < best["median_ms"]


def search(
    knobs: dict[str, list[Any]],
    base: dict[str, Any],
    measure: Measure,
    strategy: str = "greedy",
    deadline: float = float("inf"),
) -> tuple[list[dict[str, Any]], list[str]]:
    """Trials (``measure(candidate)`` each, base first) and notes on what the deadline cut."""
    trials: list[dict[str, Any]] = [measure(dict(base))]
    best, notes = trials[0], []
    for cand in _candidates(knobs, base, strategy, lambda: best["knobs"]):  # noqa: B023 - read as it changes
        if any(t["knobs"] == cand for t in trials):
            continue
        if time.monotonic() > deadline:
            notes.append(f"time budget spent after {len(trials)} candidates")
            break
        trials.append(measure(cand))
        if better(trials[-1], best):
            best = trials[-1]
    return trials, notes


def _candidates(
    knobs: dict[str, list[Any]], base: dict[str, Any], strategy: str, best: Callable[[], dict[str, Any]]
) -> Any:
    if strategy == "grid":
        for combo in itertools.product(*knobs.values()):
            yield {**base, **dict(zip(knobs, combo))}
        return
    for knob, values in knobs.items():
        for value in values:
            yield {**best(), knob: value}  # the best so far, this knob changed


def pick(trials: list[dict[str, Any]], min_gain: float = 0.0) -> dict[str, Any] | None:
    """The fastest trial that agrees with the reference, or None. The first trial (the configured settings) is kept
    unless the fastest beats it by more than ``min_gain`` (a fraction): a difference inside timing noise is no
    reason to switch (it once chose an unfused BERT graph for 0.2%, doubling the engine's size)."""
    ok = [t for t in trials if t["agrees"] and t.get("median_ms") is not None]
    if not ok:
        return None
    best, first = min(ok, key=lambda t: t["median_ms"]), trials[0]
    if first in ok and best["median_ms"] > first["median_ms"] * (1 - min_gain):
        return first
    return best


# ------------------------------------------------------------------------------------------------- agreement
def agreement(ref: list[np.ndarray], got: list[np.ndarray], rel_tie: float = 1e-3) -> dict[str, float]:
    """The comparator's worst ``cosine`` over the outputs, and ``top1_agreement`` of the first one, with near-ties
    (within ``rel_tie`` of the reference's largest magnitude) counted as agreement: random weights give near-ties
    that FP16 legitimately flips."""
    stats = compare_outputs(ref, [np.asarray(g) for g in got], rel_tie=rel_tie)
    top1 = stats["0"].top1_agreement
    return {"cosine": worst(stats, "cosine"), "top1": 1.0 if top1 is None else top1}


# ----------------------------------------------------------------------------------------------- shape check
class ShapeNotRun(RuntimeError):
    """A candidate's outputs are not those of the shape it was asked to run."""


def shape_error(ref: list[np.ndarray], got: list[Any]) -> str | None:
    """None when ``got`` has the reference's output count and shapes (the reference ran the requested batch and
    sequence on the FP32 graph); else what differs."""
    if len(got) != len(ref):
        return f"{len(got)} outputs, the reference has {len(ref)}"
    for i, (r, g) in enumerate(zip(ref, got)):
        shape = tuple(np.shape(g))
        if shape != tuple(r.shape):
            return f"output {i} has shape {list(shape)}, the reference {list(r.shape)}"
    return None


# --------------------------------------------------------------------------------------------------- measuring
class Bench:
    """Times candidates of one built engine on this machine. ``timer`` is injectable (tests); by default CUDA
    events / wall clock around a synchronizing call (``time_calls``)."""

    def __init__(
        self,
        engine_dir: Path,
        meta: dict[str, Any],
        reference: Path,
        cfg: OrtAutotuneConfig,
        timer: Timer | None = None,
        opened: list[Any] | None = None,
    ) -> None:
        import onnxruntime as ort

        self.ort, self.dir, self.meta, self.cfg, self.timer = ort, Path(engine_dir), meta, cfg, timer or time_calls
        # The build's load-check session (CPU), taken out of its list: freed once this lets it go
        self.opened = opened.pop() if opened else None
        self.cuda = meta["device"] == "cuda"
        self.models: dict[str, onnx.ModelProto] = {}
        # The FP32 reference runs on the CPU EP: independent of every knob tried here.
        self.ref = ort_session(reference, options=session_options({}))
        self.feeds: dict[int, dict[str, np.ndarray]] = {}
        self.refs: dict[int, list[np.ndarray]] = {}

    def feed(self, batch: int) -> dict[str, np.ndarray]:
        if batch not in self.feeds:
            feed = random_inputs(
                self.meta["inputs"], batch, dynamic=self.meta.get("dynamic"), hint=AUTOTUNE_SHAPES_HINT
            )
            fixed = {n: list(a.shape) for n, a in feed.items() if a.ndim == 0 or a.shape[0] != batch}
            if fixed:  # an input fixed to another batch: random_inputs keeps its size, so this is not batch `batch`
                raise ShapeNotRun(f"the engine cannot take batch {batch}: inputs fixed to {fixed}")
            self.feeds[batch] = feed
            self.refs[batch] = self.ref.run(None, self.feeds[batch])
        return self.feeds[batch]

    def measure(self, knobs: dict[str, Any], batch: int) -> dict[str, Any]:
        trial: dict[str, Any] = {"knobs": knobs, "batch": batch, "agrees": False, "median_ms": None}
        t0 = time.perf_counter()
        try:
            plan = plan_for(self.meta["files"], self.meta["session"], self.meta["cuda_graph"], knobs)
            call, fetch, graph = self._prepare(plan, batch)
            if plan["cuda_graph"] and not graph:  # timing it would mislabel a graph-less run; that one is its own trial
                raise RuntimeError("ONNX Runtime cannot capture a CUDA graph for this model and shape")
            for _ in range(self.cfg.warmup):  # cuDNN search, CUDA-graph capture, arena growth
                call()
            got = fetch()
            wrong = shape_error(self.refs[batch], got)
            if wrong:  # a trial that did not run the shape it claims is never timed
                raise ShapeNotRun(f"ran another shape than batch {batch}: {wrong}")
            quality = agreement(self.refs[batch], got)
            times = self.timer(call, self.cfg.iterations)
        except Exception as exc:  # a candidate ORT rejects here (e.g. a knob this build lacks) is recorded, not fatal
            trial["error"] = ort_reason(exc)
            log.info("autotune batch %d %s: failed (%s)", batch, knobs, trial["error"])
            return trial
        trial |= {
            "median_ms": round(float(np.median(times)), 4),
            "p90_ms": round(float(np.percentile(times, 90)), 4),
            "runs": len(times),
            **{k: round(v, 8) for k, v in quality.items()},
            "agrees": quality["cosine"] >= self.cfg.min_cosine and quality["top1"] >= self.cfg.min_top1,
            "seconds": round(time.perf_counter() - t0, 2),
        }
        log.info(
            "autotune batch %d %s: %.3f ms, cos %.6f%s",
            batch,
            knobs,
            trial["median_ms"],
            trial["cosine"],
            "" if trial["agrees"] else " (disagrees)",
        )
        return trial

    def _model(self, file: str) -> onnx.ModelProto:
        if file not in self.models:
            self.models[file] = onnx.load(str(self.dir / file))
        return self.models[file]

    def _reused(self, plan: dict[str, Any]) -> Any:
        """The build's load-check session for a candidate that opens the same file with the same settings (the
        configured ones, tried first): no second session for them. Released at the first other candidate."""
        same = plan["model"] == self.meta["files"]["model"] and plan["settings"] == self.meta["session"]
        if not same:
            self.opened = None
        return self.opened

    def _prepare(self, plan: dict[str, Any], batch: int) -> tuple[Callable[[], Any], Callable, bool]:
        """``call`` runs once the way the runner would; ``fetch`` returns the last outputs as host arrays; the flag
        says whether ``call`` replays a CUDA graph."""
        model, feed = self._model(plan["model"]), self.feed(batch)
        if not self.cuda:
            session = self._reused(plan) or open_session(self.ort, model, plan)
            last: list[Any] = []

            def run_cpu() -> None:
                last[:] = session.run(None, feed)

            return run_cpu, lambda: last, False
        # Static output buffers: the reference's shapes, the engine graph's declared dtypes.
        to_np = onnx.helper.tensor_dtype_to_np_dtype
        dtypes = {o.name: to_np(o.type.tensor_type.elem_type) for o in model.graph.output}
        outs = {o.name: np.empty(r.shape, dtypes[o.name]) for o, r in zip(self.ref.get_outputs(), self.refs[batch])}
        first = plan["providers"][0]
        slot = cuda_slot(self.ort, model, plan, feed, outs, int(first[1].get("device_id", 0)), self.meta["name"])
        load_slot(self.ort, slot, feed)
        run = slot["session"].run_with_iobinding
        return (lambda: run(slot["binding"])), slot["binding"].copy_outputs_to_cpu, slot["static"]


# ------------------------------------------------------------------------------------------------- entry point
def relevant_knobs(knobs: dict[str, list[Any]], conv: bool, fused: bool) -> dict[str, list[Any]]:
    """Drop knobs that cannot change anything for this model (and empty value lists); unknown names are errors."""
    unknown = sorted(set(knobs) - KNOBS)
    if unknown:
        raise ConfigError(f"build.onnxruntime.autotune: unknown knobs {unknown}", hint=f"use some of {sorted(KNOBS)}")
    moot = set() if conv else {"prefer_nhwc", "conv_algo_search", "conv_max_workspace"}
    moot |= set() if fused else {"transformer_fusion"}
    return {k: list(v) for k, v in knobs.items() if k not in moot and v}


def autotune(
    engine_dir: Path,
    meta: dict[str, Any],
    reference: Path,
    cfg: OrtAutotuneConfig,
    base: dict[str, Any],
    knobs: dict[str, list[Any]],
    batches: list[int],
    per_batch: bool,
    timer: Timer | None = None,
    opened: list[Any] | None = None,
) -> dict[str, Any]:
    """Search ``knobs`` from ``base`` and return the sidecar's ``autotune`` record.

    ``per_batch``: one search and one choice per batch size (CUDA: the runner keeps a session per shape); else one
    search whose objective is the sum of the batches' medians, and one choice (CPU: one session for all shapes).
    ``opened``: ``[session]``, the build's CPU session on the engine file with its recorded settings, which the
    candidate with those settings reuses (taken out of the list: nothing else holds it while other candidates run).
    """
    bench = Bench(engine_dir, meta, reference, cfg, timer, opened)
    t0, notes = time.monotonic(), []
    record: dict[str, Any] = {
        "strategy": cfg.strategy,
        "base": base,
        "knobs": knobs,
        "batches": batches,
        "iterations": cfg.iterations,
        "warmup": cfg.warmup,
        "criteria": {"min_cosine": cfg.min_cosine, "min_top1": cfg.min_top1, "min_gain": cfg.min_gain},
    }
    if per_batch:
        trials, choices = [], {}
        for i, b in enumerate(batches):  # an even share of what is left of the budget per batch size
            deadline = time.monotonic() + (cfg.time_budget_s - (time.monotonic() - t0)) / (len(batches) - i)
            got, cut = search(knobs, base, lambda k, b=b: bench.measure(k, b), cfg.strategy, deadline)
            trials += got
            notes += [f"batch {b}: {n}" for n in cut]
            choices[str(b)] = _choice(got, base, notes, f"batch {b}", cfg.min_gain)
        record |= {"trials": trials, "choice_by_batch": choices, "choice": choices[str(max(batches))]}
    else:

        def total(k: dict[str, Any]) -> dict[str, Any]:
            parts = [bench.measure(k, b) for b in batches]
            ok = all(p["median_ms"] is not None for p in parts)
            return {
                "knobs": k,
                "by_batch": [{x: v for x, v in p.items() if x != "knobs"} for p in parts],
                "agrees": all(p["agrees"] for p in parts),
                "median_ms": round(sum(p["median_ms"] for p in parts), 4) if ok else None,
            }

        trials, cut = search(knobs, base, total, cfg.strategy, t0 + cfg.time_budget_s)
        notes += cut
        record |= {"trials": trials, "choice": _choice(trials, base, notes, "all batches", cfg.min_gain)}
    record |= {"notes": notes, "seconds": round(time.monotonic() - t0, 2)}
    return record


def _choice(
    trials: list[dict[str, Any]], base: dict[str, Any], notes: list[str], what: str, min_gain: float
) -> dict[str, Any]:
    best = pick(trials, min_gain)
    if best is None:
        notes.append(f"{what}: no candidate agreed with the reference; keeping the configured settings")
        log.warning("autotune %s: no candidate agreed with the FP32 reference; keeping the configured settings", what)
        return {"knobs": dict(base), "median_ms": None, "reason": "no candidate agreed"}
    base_ms = next((t["median_ms"] for t in trials if t["knobs"] == base and t["median_ms"] is not None), None)
    return {
        "knobs": best["knobs"],
        "median_ms": best["median_ms"],
        "base_ms": base_ms,
        "speedup_vs_base": round(base_ms / best["median_ms"], 3) if base_ms and best["median_ms"] else None,
    }
