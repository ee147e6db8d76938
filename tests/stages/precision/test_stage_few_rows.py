"""The pipeline's precision stage warns where calibration reads fewer than 32 rows though more were asked, as
``kiln precision`` warns of a short ``--calibration``."""

from __future__ import annotations

import logging

import pytest
import torch

from kiln.calibration.config import CalibrationConfig
from kiln.calibration.data import dataset_batches
from kiln.core.data import DatasetSplits
from kiln.stages.precision.stage import warn_few_calibration_rows

LOG = logging.getLogger("kiln.test.precision")


def _data(train: int) -> DatasetSplits:
    return DatasetSplits(torch.rand(train, 4), torch.rand(train), torch.rand(10, 4), torch.rand(10))


def _said(caplog: pytest.LogCaptureFixture, data: DatasetSplits, ccfg: CalibrationConfig) -> list[str]:
    batches: list = dataset_batches(data, ccfg)
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        warn_few_calibration_rows(LOG, batches, ccfg, ["fp32", "int8"], data)
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_a_small_training_split_is_warned_of_with_the_keys_that_ask_for_rows(
    caplog: pytest.LogCaptureFixture,
) -> None:
    said = _said(caplog, _data(30), CalibrationConfig())
    assert len(said) == 1, said
    assert "only 30 rows" in said[0] and "num_batches 8 x batch_size 32 = 256 asked" in said[0], said[0]
    assert "training split holds 30" in said[0] and "INT8 scales" in said[0] and "at least 32" in said[0], said[0]


def test_enough_rows_or_few_asked_for_say_nothing(caplog: pytest.LogCaptureFixture) -> None:
    assert _said(caplog, _data(40), CalibrationConfig()) == []
    assert _said(caplog, _data(30), CalibrationConfig(num_batches=2, batch_size=8)) == []  # 16 asked, 16 read
