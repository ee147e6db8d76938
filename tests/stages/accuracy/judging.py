"""An engine judged against a held-out reference as validation and the precision stage judge it, for the tests."""

from __future__ import annotations

from typing import Any

from kiln.core.records import EngineValidation
from kiln.stages.accuracy.check import accuracy_failures, compare_on, gates_for, summarize
from kiln.stages.accuracy.config import CheckConfig


def judged(
    ref: Any, engine: Any, batches: list[int], precision: str, cfg: CheckConfig | None = None
) -> tuple[EngineValidation, list[str]]:
    """``engine`` compared with ``ref`` at ``batches``, the entry's headline values (accuracy and metric too) and
    the gates of ``precision`` it misses."""
    cfg = cfg or CheckConfig()
    found = compare_on(ref, engine, batches)
    entry = EngineValidation(name="e", backend="onnxruntime", precision=precision, device="cpu", status="validated")
    summarize(entry, found.stats, ref.logits)
    entry.accuracy, entry.metric = found.accuracy, found.metric
    gates = gates_for(cfg, precision, ref.logits is None)
    return entry, accuracy_failures(entry, gates, ref.accuracy, ref.metric, ref.metric_value)
