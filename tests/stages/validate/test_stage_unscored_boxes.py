"""A detector's labelled boxes that no metric scores: the validate stage's warning names detection_recall, and none
is said where validate.metric is set."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from kiln.core.data import DatasetSplits, as_feed
from kiln.core.signature import Signature
from kiln.models.config import ModelConfig
from kiln.stages.accuracy.check import held_out
from kiln.stages.accuracy.config import CheckConfig
from kiln.stages.accuracy.metrics import BOX_FORMAT
from kiln.stages.validate.stage import reference, unscored
from tests.stages.validate.test_stage_unscored import _unscored

g = torch.Generator().manual_seed(0)
X = torch.randn(16, 3, generator=g)
BOXES = torch.cat([torch.randint(0, 3, (16, 4, 1), generator=g).float(), torch.rand(16, 4, 4, generator=g)], -1)


def _detector(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Class scores [N, 10, 3] and boxes [N, 10, 4], as a DETR-like head gives them."""
    x = feed["input"]
    return {"logits": np.repeat(x[:, None, :], 10, 1), "pred_boxes": np.repeat(x[:, None, :1], 10, 1).repeat(4, 2)}


def test_labelled_boxes_beside_a_boxes_output_are_told_to_set_detection_recall() -> None:
    said = _unscored(DatasetSplits(X, BOXES, X, BOXES, num_classes=3), _detector, ["logits", "pred_boxes"])
    assert said is not None and "float32[16, 4, 5]" in said, said
    assert "validate.metric: detection_recall" in said and "'pred_boxes'" in said and BOX_FORMAT in said, said


def test_no_metric_is_asked_for_where_validate_metric_is_set() -> None:
    data = DatasetSplits(X, BOXES, X, BOXES, num_classes=3)
    ctx = SimpleNamespace(config=SimpleNamespace(signature=Signature(batch_sizes=[1, 8]), model=ModelConfig()))
    feeds = held_out(data, lambda v: as_feed(v, ["input"]), {}, {}, None)
    cfg = CheckConfig(metric="detection_recall")
    ref = reference(ctx, data, cfg, _detector, feeds, ["logits", "pred_boxes"], {})
    assert ref.metric is not None and unscored(ref, data, None) is None
