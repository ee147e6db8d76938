"""The validate stage warns when the reference itself answers NaN: the comparison sets a NaN the engine shares
aside, so such an output passes every gate while served clients receive NaN."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from kiln.core.data import DatasetSplits, as_feed
from kiln.core.signature import Signature
from kiln.models.config import ModelConfig
from kiln.stages.accuracy.check import held_out
from kiln.stages.accuracy.config import CheckConfig
from kiln.stages.validate.stage import reference, reference_nan

X = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
Y = torch.randint(0, 2, (16,), generator=torch.Generator().manual_seed(1))


def _padded_softmax(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Graph logits, and node scores through a softmax over a row that is all -inf at the last two nodes."""
    x = torch.from_numpy(feed["input"])
    scores = torch.zeros(len(x), 4, 1)
    scores[:, 2:] = float("-inf")
    nodes = x[..., None] * torch.softmax(scores, -1)
    return {"logits": x[:, :2].numpy(), "node_logits": nodes.numpy()}


def _said(run) -> list[str]:
    data = DatasetSplits(X, Y, X, Y, 2)
    ctx = SimpleNamespace(config=SimpleNamespace(signature=Signature(batch_sizes=[1, 8]), model=ModelConfig()))
    feeds = held_out(data, lambda v: as_feed(v, ["input"]), {}, {}, None)
    ref = reference(ctx, data, CheckConfig(), run, feeds, ["logits", "node_logits"], {})
    return reference_nan(ref.outputs)


def test_nan_in_the_reference_itself_is_warned_of_per_output_with_values_and_rows() -> None:
    """NaN at padded nodes (a softmax over a fully -inf row) passed every gate with cosine 1 and no word."""
    said = _said(_padded_softmax)
    assert len(said) == 1, said
    assert said[0].startswith("reference output 'node_logits' is NaN at 32 of 64 values, in 16 of 16 rows"), said
    assert "set aside" in said[0] and "clients receive NaN" in said[0], said
    assert "large negative number instead of -inf" in said[0], said


def test_finite_reference_outputs_say_nothing() -> None:
    assert _said(lambda f: {"logits": f["input"][:, :2], "node_logits": f["input"][..., None]}) == []
