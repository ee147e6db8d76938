"""A multi-label head's scoring: multilabel_f1 decides at the reference's threshold for every engine, a num_classes
other than the head's width is refused rather than leaving the decision gate off, and integer multi-hot labels are
told to become floats."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.core.data import DatasetSplits
from kiln.core.errors import ConfigError, ModelError
from kiln.stages.accuracy.check import check_labels_fit, multi_label_default
from kiln.stages.accuracy.metrics import decided_by, resolve_metric

TARGETS = np.array([[0, 1, 1], [1, 0, 1]], dtype=np.float32)


def test_multilabel_f1_scores_every_engine_at_the_references_threshold() -> None:
    """Scores within [0, 1] decide at 0.5; an engine with one value strayed to -0.001 was scored at 0 instead."""
    ref = np.array([[0.02, 0.92, 0.6], [0.7, 0.1, 0.8]], dtype=np.float32)
    engine = ref.copy()
    engine[0, 0] = -0.001
    metric = decided_by(resolve_metric("multilabel_f1", "logits"), {"logits": ref})
    assert metric is not None
    assert metric({"logits": ref}, TARGETS) == 1.0
    assert metric({"logits": engine}, TARGETS) == 1.0


def _data(num_classes: int) -> DatasetSplits:
    y = torch.tensor(TARGETS)
    return DatasetSplits(torch.randn(2, 5), y, torch.randn(2, 5), y, num_classes=num_classes)


def test_num_classes_other_than_the_label_width_is_refused() -> None:
    outputs = {"logits": np.zeros((2, 3), dtype=np.float32)}
    assert multi_label_default(outputs, _data(3)) == "logits"
    with pytest.raises(ConfigError, match="3 labels per row, the dataset declares num_classes=5") as info:
        multi_label_default(outputs, _data(5))
    assert "num_classes=3" in (info.value.hint or "")


def test_integer_multi_hot_held_out_labels_are_told_to_be_floats() -> None:
    with pytest.raises(ModelError) as info:
        check_labels_fit(np.zeros((2, 3), dtype=np.float32), TARGETS.astype(np.int64), "logits")
    hint = info.value.hint or ""
    assert "cast them to float" in hint and "relative error" not in hint
