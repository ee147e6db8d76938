"""A named class-logit output demoted to a regression's prediction (float targets, no num_classes) is warned of,
with the fix, where it has several columns the targets do not match (a multi-task model's class logits); a run says
it once (core/logs.SaidOnce)."""

import logging

import numpy as np
import pytest
import torch

from kiln.core.data import DatasetSplits
from kiln.stages.accuracy.check import top1_output


def test_named_class_logits_beside_unmatched_float_targets_are_warned_of(
    caplog: pytest.LogCaptureFixture,
) -> None:
    x = torch.randn(40, 8, generator=torch.Generator().manual_seed(0))
    y = torch.cat([x[:, :1].gt(0).float(), x[:, 1:3]], 1)  # class index, then two values: [N, 3] floats
    data = DatasetSplits(x[:32], y[:32], x[32:], y[32:])
    cls = np.zeros((8, 5), np.float32)
    with caplog.at_level(logging.INFO, logger="kiln"):
        assert top1_output("cls", data, named=True, output=cls, rows=8) is None
    said = [r for r in caplog.records if "holds the prediction of float targets" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    assert "give num_classes in the data function" in said[0].getMessage()
