"""Accuracy-driven fallback: build a variant, compare it with FP32, and while it misses the target keep the
nodes that introduce the most error in FP32 and rebuild — up to ``max_rounds`` times, and only while the rounds
measurably improve on the best before them: the variant is the best round's graph, and the nodes later rounds
kept without a measured gain are dropped (a node kept in float costs speed).

A node's blame is how much larger the error of its output is than the error of its inputs (both relative
to the FP32 graph on the same samples): error a node merely passes on is not its fault. When a node already
kept in FP32 still tops the list, the damage arrives through its inputs' rounding (e.g. ``(x + 4096) - 4096``),
so its producers are kept next.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from kiln.core.text import fmt
from kiln.stages.precision.compare import Samples, output_metrics, run_batched, take_rows, tensor_errors
from kiln.stages.precision.config import FallbackConfig
from kiln.stages.precision.fp16_select import INDEX_OPS

log = logging.getLogger("kiln.precision")
BLAME_SAMPLES = 32  # per-tensor comparison holds every activation in memory: a few samples suffice


@dataclass
class FallbackResult:
    path: Path
    kept: dict[str, str] = field(default_factory=dict)
    rounds: list[dict[str, Any]] = field(default_factory=list)
    passed: bool = True

    def summary(self) -> dict[str, Any]:
        return {"passed": self.passed, "rounds": self.rounds, "kept": self.kept}


def passes(metrics: dict[str, float | None], cfg: FallbackConfig) -> bool:
    """Both targets on the comparator's statistics; an output without a class axis has no top-1 to check."""
    top1 = metrics["top1_agreement"]
    ok = top1 is None or top1 >= cfg.min_top1_agreement
    if cfg.min_cosine is not None:
        ok = ok and metrics["cosine"] >= cfg.min_cosine  # NaN (non-finite outputs) fails too
    return ok


# A round improves on the best before it by MIN_TOP1_GAIN top-1 agreement, or at the same top-1 by MIN_COSINE_GAIN
# cosine; after PATIENCE rounds without (a consumer kept first, its producer next: two rounds) the search stops.
PATIENCE = 2
MIN_TOP1_GAIN = 1e-3  # a round improves by this much top-1 agreement...
MIN_COSINE_GAIN = 1e-5  # ...or, at the same top-1, by this much cosine


def improves(metrics: dict[str, float | None], than: dict[str, float | None]) -> bool:
    """Whether a round's comparison is measurably better than an earlier one's (NaN is worst)."""
    top1, before = metrics["top1_agreement"], than["top1_agreement"]
    cos, cos_before = _finite(metrics["cosine"]), _finite(than["cosine"])
    if top1 is not None and before is not None and abs(top1 - before) >= MIN_TOP1_GAIN:
        return top1 > before
    return cos - cos_before >= MIN_COSINE_GAIN


def _finite(x: float | None) -> float:
    return float(x) if x is not None and np.isfinite(x) else -2.0


def run_fallback(
    build: Callable[[set[str]], Path],
    fp32: onnx.ModelProto,
    x: Samples,
    cfg: FallbackConfig,
    candidates: set[str],
    label: str,
    logits: int | None = 0,
    where: np.ndarray | None = None,
) -> FallbackResult:
    """``build(extra_fp32_nodes) -> model path``. ``candidates``: nodes whose precision ``build`` can change.
    Every graph output is compared (the worst must meet the targets); ``logits``: the index of the class-logit
    output whose top-1 agreement is checked (None: none), over the positions ``where`` marks (None: all)."""
    refs = run_batched(fp32, x)
    kept: dict[str, str] = {}
    result = FallbackResult(path=Path())
    best: tuple[dict[str, float | None], int, dict[str, str]] | None = None  # metrics, round, nodes kept
    for round_no in range(cfg.max_rounds + 1):
        result.path = build(set(kept))
        gots = run_batched(result.path, x)
        metrics = output_metrics(refs, gots, logits, where)
        result.rounds.append({"round": round_no, "kept": len(kept), **metrics})
        result.passed = passes(metrics, cfg)
        log.info(
            "%s round %d: top-1 agreement %s cosine %.5f (%d nodes kept FP32)",
            label,
            round_no,
            fmt(metrics["top1_agreement"]),
            metrics["cosine"],
            len(kept),
        )
        if best is None or improves(metrics, best[0]):
            best = (metrics, round_no, dict(kept))
        elif _finite(best[0]["cosine"]) > -2.0 and round_no - best[1] >= PATIENCE:
            break  # these rounds' nodes bought nothing measurable (while outputs overflow, the search goes on)
        if result.passed or not cfg.enabled or round_no == cfg.max_rounds:
            break
        picks = blame(
            fp32,
            result.path,
            _informative(x, refs[logits or 0], gots[logits or 0]),
            candidates,
            set(kept),
            cfg.nodes_per_round,
        )
        if not picks:
            log.warning("%s: no node left to keep in FP32; accuracy target not reachable by fallback", label)
            break
        for name, why in picks.items():
            kept[name] = f"fallback round {round_no + 1}: {why}"
    if best is not None and best[1] != len(result.rounds) - 1:  # a later round was no better: the best one's graph
        log.info("%s: rounds after %d did not improve on it; the variant is round %d's", label, best[1], best[1])
        kept = best[2]
        result.path = build(set(kept))
        result.passed = passes(best[0], cfg)
        for entry in result.rounds[best[1] + 1 :]:
            entry["discarded"] = True
    result.kept = kept
    return result


def _informative(x: Samples, ref: np.ndarray, got: np.ndarray) -> Samples:
    """Samples whose prediction flipped first (they show the damage), topped up with the rest."""
    flipped = ref.reshape(len(ref), -1).argmax(1) != got.reshape(len(got), -1).argmax(1)
    order = np.concatenate([np.flatnonzero(flipped), np.flatnonzero(~flipped)])
    return take_rows(x, order[:BLAME_SAMPLES])


def blame(
    fp32: onnx.ModelProto, model: Path, x: Samples, candidates: set[str], kept: set[str], count: int
) -> dict[str, str]:
    """The ``count`` nodes whose output error most exceeds their inputs' error, with a reason each."""
    nodes = [n for n in fp32.graph.node if n.op_type not in INDEX_OPS and n.output]
    float_tensors = _float_tensors(fp32)
    tensors = sorted({o for n in nodes for o in n.output if o in float_tensors})
    err = tensor_errors(fp32, model, x, tensors)
    producers = {o: n for n in fp32.graph.node for o in n.output}
    scored: list[tuple[float, onnx.NodeProto, float]] = []
    for n in nodes:
        out_err = max((err.get(o, 0.0) for o in n.output), default=0.0)
        in_err = max((err.get(i, 0.0) for i in n.input), default=0.0)
        jump = _jump(out_err, in_err)
        scored.append((jump, n, out_err))
    scored.sort(key=lambda s: -s[0])
    picks: dict[str, str] = {}
    for jump, n, out_err in scored:
        if len(picks) >= count or not jump > 1e-6:
            break
        why = (
            f"output error {out_err:.3g} vs inputs' {out_err - jump:.3g} (relative L2 vs FP32)"
            if np.isfinite(jump)
            else "first node whose output is not finite (FP16 overflow)"
        )
        if n.name in kept:  # the error comes in through its inputs: keep the nodes that produce them
            for i in n.input:
                p = producers.get(i)
                if p is not None and p.name in candidates and p.name not in kept and p.op_type not in INDEX_OPS:
                    picks.setdefault(p.name, f"feeds {n.name} (kept FP32) whose {why}")
        elif n.name in candidates:
            picks[n.name] = why
    return picks


def _jump(out_err: float, in_err: float) -> float:
    """Error a node adds. The first node whose output is non-finite gets infinite blame; its consumers none."""
    if not np.isfinite(out_err):
        return float("inf") if np.isfinite(in_err) else 0.0
    return out_err - in_err if np.isfinite(in_err) else 0.0


def _float_tensors(model: onnx.ModelProto) -> set[str]:
    vis = [*model.graph.value_info, *model.graph.output, *model.graph.input]
    return {v.name for v in vis if v.type.tensor_type.elem_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)}
