"""Beside detection labels (float [N, M, 5]), the class-logit output is the class scores detection_recall reads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.core.output_names import class_logits, detection_labels


def _labels() -> torch.Tensor:
    return torch.tensor([[[1.0, 0.1, 0.1, 0.5, 0.5], [-1.0, 0.0, 0.0, 0.0, 0.0]]]).repeat(4, 1, 1)


@pytest.mark.parametrize(
    "names, scores",
    [
        (["logits", "pred_boxes"], "logits"),  # DetrForObjectDetection's, [N, Q, C + 1] beside [N, Q, 4]
        (["boxes", "scores"], "scores"),
        (["bbox", "output_1"], "output_1"),  # the one output beside the boxes
        (["output_0", "output_1"], None),  # names that do not tell: no guess
    ],
)
def test_detection_labels_take_the_score_output_as_class_logits(names: list[str], scores: str | None) -> None:
    assert class_logits(names, None, _labels(), num_classes=3) == scores


def test_other_float_targets_and_a_named_output_keep_their_rules() -> None:
    assert class_logits(["logits", "pred_boxes"], None, torch.randn(4, 2, 4)) is None  # a regression's values
    assert class_logits(["logits", "pred_boxes"], "pred_boxes", _labels()) == "pred_boxes"
    assert not detection_labels(np.zeros((4, 2, 5), dtype=np.int64)) and detection_labels(_labels())
