"""A metric function with ``versus_reference = True`` scores each engine against the reference's outputs even where
the data has labels (a CTC model's, which training needs): "does it decide as PyTorch does" is the user's question,
which a metric against the labels does not answer."""

from __future__ import annotations

import numpy as np
import torch

from kiln.core.data import DatasetSplits, as_feed
from kiln.stages.accuracy.check import Reference, held_out, held_out_reference
from kiln.stages.accuracy.config import CheckConfig
from kiln.stages.accuracy.metrics import resolve_metric
from tests.stages.accuracy.judging import judged

W = np.random.default_rng(3).standard_normal((4, 3))
GIVEN: list[object] = []  # what same_decision was given as its labels, per call


def logits(x: np.ndarray) -> np.ndarray:
    return x @ W


def hard(x: np.ndarray) -> np.ndarray:
    """The rows the reference gets wrong (their labels are another class than its decision)."""
    return x[:, 0] > 0.8


def same_decision(outputs: dict[str, np.ndarray], labels: dict[str, np.ndarray]) -> float:
    """The share of rows whose decision is the reference's (its outputs are the labels)."""
    GIVEN.append(labels)
    return float(np.mean(outputs["logits"].argmax(-1) == labels["logits"].argmax(-1)))


same_decision.versus_reference = True  # type: ignore[attr-defined]


def label_accuracy(outputs: dict[str, np.ndarray], labels: np.ndarray) -> float:
    return float(np.mean(outputs["logits"].argmax(-1) == labels))


def reference(metric: str) -> Reference:
    x = np.random.default_rng(0).standard_normal((64, 4)).astype(np.float32)
    y = logits(x).argmax(-1)
    y = np.where(hard(x), (y + 1) % 3, y)  # the reference is wrong on the hard rows
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    data = DatasetSplits(xt[:32], yt[:32], xt[32:], yt[32:], num_classes=3)
    feeds = held_out(data, lambda v: as_feed(v, ["x"]), {}, {}, None)
    run = lambda feed: {"logits": logits(feed["x"])}  # noqa: E731
    return held_out_reference(run, feeds, data, "logits", CheckConfig(metric=metric), [1, 8], {})


def flipped(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """An engine that decides a third class on the hard rows: as wrong as the reference there, yet not its decision."""
    out = logits(feed["x"])
    top = out.argmax(-1)
    other = (top + 2) % 3
    rows = np.flatnonzero(hard(feed["x"]))
    out[rows, other[rows]] = out[rows, top[rows]] + 1.0
    return {"logits": out}


def test_the_attribute_scores_against_the_reference_where_labels_exist() -> None:
    GIVEN.clear()
    name = f"{__name__}:same_decision"
    ref = reference(name)
    assert ref.metric is not None and ref.metric.versus_reference
    assert ref.metric_value == 1.0  # the reference against itself
    assert isinstance(GIVEN[-1], dict) and set(GIVEN[-1]) == {"logits"}  # the reference's outputs, not the labels
    entry, failures = judged(ref, flipped, [1, 8], "int8", CheckConfig(metric=name))
    assert entry.metric is not None and entry.metric < 0.95
    assert f"{name} {entry.metric:.4g} vs 1: drop {1 - entry.metric:.4g} > max_metric_drop 0.01" in failures


def test_a_label_scored_metric_passes_the_same_engine() -> None:
    """Against the labels the flipped engine is as accurate as the reference: only the reference's outputs tell."""
    name = f"{__name__}:label_accuracy"
    ref = reference(name)
    assert ref.metric is not None and not ref.metric.versus_reference
    entry, failures = judged(ref, flipped, [1, 8], "int8", CheckConfig(metric=name))
    assert entry.metric == ref.metric_value
    assert not [f for f in failures if f.startswith(name)], failures


def test_a_built_in_ignores_the_attribute() -> None:
    metric = resolve_metric("accuracy", "logits")
    assert metric is not None and not metric.versus_reference
