"""An engine's gates at validation: the accuracy gates as the precision stage applies them, and the latency budget.
No torch here: ``kiln validate ENGINE --reference FILE.onnx`` judges engines without it."""

from __future__ import annotations

from typing import Any

from kiln.core.records import EngineValidation
from kiln.stages.accuracy.check import LATENCY_GATE, accuracy_failures
from kiln.stages.accuracy.metrics import Metric


def check_gates(
    entry: EngineValidation,
    baseline_acc: float | None,
    gates: dict[str, Any],
    largest: int,
    metric: Metric | None = None,
    baseline_metric: float | None = None,
) -> list[str]:
    """Each gate the engine misses: the accuracy gates (:func:`accuracy_failures`, as the precision stage applies
    them) and the latency budget at the largest batch."""
    fails = accuracy_failures(entry, gates, baseline_acc, metric, baseline_metric)
    budget = gates["max_latency_p50_ms"]
    latency = entry.latency_ms.get(str(largest))
    if budget is not None and latency is not None and latency.p50 > budget:
        fails.append(f"{LATENCY_GATE} {latency.p50:.3f} ms at batch {largest} > {budget} ms")
    return fails
