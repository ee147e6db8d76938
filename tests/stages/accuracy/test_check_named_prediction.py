"""Naming a regression's prediction with signature.logits_output is the setting's use: no warning."""

import logging

import numpy as np
import pytest
import torch

from kiln.core.data import DatasetSplits
from kiln.stages.accuracy.check import top1_output


def test_naming_a_regressions_prediction_is_said_as_information(caplog: pytest.LogCaptureFixture) -> None:
    x = torch.randn(40, 8, generator=torch.Generator().manual_seed(0))
    data = DatasetSplits(x[:32], x[:32, :4] * 2.0, x[32:], x[32:, :4] * 2.0)  # float targets, no num_classes
    with caplog.at_level(logging.INFO, logger="kiln.validate"):
        assert top1_output("output_0", data, named=True, output=np.zeros((8, 4), np.float32), rows=8) is None
    said = [r for r in caplog.records if "holds the prediction of float targets" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO
