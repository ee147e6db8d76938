"""torchrun's output relayed into Kiln's log: a worker's warning reaches the user once, not only at -v."""

from __future__ import annotations

import logging

import pytest

from kiln.stages.train.launch import relay


def test_a_workers_warning_is_a_warning_once_and_the_rest_is_info(caplog: pytest.LogCaptureFixture) -> None:
    log, said = logging.getLogger("kiln.train.test_relay"), set()
    lines = [
        "[rank 0] WARNING kiln.train: 501 samples over 2 processes: DistributedSampler repeats 1 samples",
        "[rank 1] WARNING kiln.train: 501 samples over 2 processes: DistributedSampler repeats 1 samples",
        "[rank 0] INFO kiln.train: epoch 1/2 loss 0.7",
        "W1205 16:00:00.000 torch/distributed/run.py:793] OMP_NUM_THREADS set to 1",
    ]
    with caplog.at_level(logging.INFO, logger=log.name):
        for line in lines:
            relay(line, log, said)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "501 samples over 2 processes: DistributedSampler repeats 1 samples (from the torchrun workers)"
    ]
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(infos) == 2 and all(m.startswith("[torchrun] ") for m in infos)
    assert not any("DistributedSampler" in m for m in infos)  # -v prints the warning once, not again from rank 1
