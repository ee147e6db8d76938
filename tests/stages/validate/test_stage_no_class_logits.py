"""Integer labels beside outputs none of which is held as class logits: the validate stage warns that no top-1
agreement or accuracy gates the engines, naming the one output whose class axis holds the data's classes."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kiln.core.data import DatasetSplits, as_feed
from kiln.core.signature import Signature
from kiln.models.config import ModelConfig
from kiln.stages.accuracy.check import held_out
from kiln.stages.accuracy.config import CheckConfig
from kiln.stages.validate import stage

X = torch.randn(16, 6, generator=torch.Generator().manual_seed(0))
Y = torch.arange(16) % 4  # integer labels of 4 classes


def _logits_and_aux(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A (logits, aux_loss) tuple's outputs: [N, 4] class logits beside a 0-D auxiliary loss."""
    x = feed["input"]
    return {"output_0": x[:, :4], "output_1": np.asarray(x.sum(), dtype=np.float32)}


def _two_heads(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Two [N, 4] outputs: either could be the class logits."""
    x = feed["input"]
    return {"output_0": x[:, :4], "output_1": x[:, 2:]}


def _warned(run, caplog: pytest.LogCaptureFixture) -> list[str]:
    """What the stage warns of for ``run``'s reference on the integer-labelled data."""
    data = DatasetSplits(X, Y, X, Y, num_classes=4)
    ctx = SimpleNamespace(config=SimpleNamespace(signature=Signature(batch_sizes=[1, 8]), model=ModelConfig()))
    feeds = held_out(data, lambda v: as_feed(v, ["input"]), {}, {}, None)
    ref = stage.reference(ctx, data, CheckConfig(), run, feeds, ["output_0", "output_1"], {})
    assert ref.logits is None and ref.accuracy is None
    log = logging.getLogger("tests.validate.no_class_logits")  # outside "kiln", which CLI tests stop propagating
    with caplog.at_level(logging.INFO, logger=log.name):
        stage.say_no_class_logits(log, ref, data)
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_a_tuple_with_an_aux_loss_warns_that_no_accuracy_gates_and_names_the_logits(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A (logits, aux) model passed with top-1 and accuracy ungated, said only inside report.md."""
    said = _warned(_logits_and_aux, caplog)
    assert len(said) == 1, said
    assert "no top-1 agreement or task accuracy gates the engines" in said[0], said
    assert "2 outputs (output_0, output_1), none named 'logits'" in said[0], said
    assert "; set signature.logits_output: output_0, the one output whose class axis holds the 4 classes" in said[0], (
        said
    )


def test_several_outputs_with_the_class_axis_name_none(caplog: pytest.LogCaptureFixture) -> None:
    said = _warned(_two_heads, caplog)
    assert len(said) == 1 and "set signature.logits_output to the class-logit output" in said[0], said
