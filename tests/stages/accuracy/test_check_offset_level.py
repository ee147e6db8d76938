"""A regression output on a level far above how it varies between samples (a series around 1000 that moves by
under 1): its relative error is over the spread floor (1 % of its RMS). An engine whose error is larger than the
output ever varies is said to be so, with no setting offered to accept it and no blame on the held-out inputs; a
small error over that floor still names the settings that accept it."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from kiln.core.data import DatasetSplits, as_feed
from kiln.core.records import EngineValidation
from kiln.core.signature import Signature
from kiln.models.config import ModelConfig
from kiln.stages.accuracy.check import accuracy_failures, compare_on, gates_for, held_out, summarize
from kiln.stages.accuracy.config import CheckConfig

RNG = np.random.default_rng(0)
W = RNG.standard_normal((4, 3)).astype(np.float32) * 0.4
X = torch.from_numpy(RNG.standard_normal((96, 4)).astype(np.float32))


def _failures(shift: float, level: float) -> tuple[EngineValidation, list[str]]:
    """An INT8 engine's entry and failures, its forecast (around ``level``) off by ``shift`` times the output's
    spread, as noise."""
    from kiln.stages.validate.stage import reference

    def _forecast(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"forecast": level + feed["input"] @ W}

    data = DatasetSplits(X[:32], None, X[32:], torch.from_numpy(_forecast({"input": X[32:].numpy()})["forecast"]))
    ctx = SimpleNamespace(
        config=SimpleNamespace(signature=Signature(batch_sizes=[1, 8]), validate=CheckConfig(), model=ModelConfig())
    )
    feeds = held_out(data, lambda v: as_feed(v, ["input"]), {}, {}, None)
    ref = reference(ctx, data, CheckConfig(), _forecast, feeds, ["forecast"], {})
    spread = float(np.std(ref.outputs[-1]["forecast"], axis=0).mean())

    def engine(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = _forecast(feed)["forecast"]
        noise = np.sin(np.arange(out.size, dtype=np.float64) * 1.7).reshape(out.shape) * np.sqrt(2)
        return {"forecast": (out + shift * spread * noise).astype(np.float32)}

    found = compare_on(ref, engine, [1, 8])
    entry = EngineValidation(name="e", backend="onnxruntime", precision="int8", device="cpu", status="validated")
    summarize(entry, found.stats, ref.logits)
    return entry, accuracy_failures(entry, gates_for(CheckConfig(), "int8", True), None)


def test_an_error_larger_than_the_output_varies_is_said_so_and_not_offered_to_accept() -> None:
    entry, fails = _failures(5.0, 1000.0)  # spread 0.08 % of the level
    (said,) = fails
    assert "x the spread of the output between the held-out samples" in said, said
    assert "to accept it" not in said and "vary more" not in said, said
    assert entry.outputs["forecast"]["over_variation"] > 3, entry.outputs


def test_a_small_error_over_the_floor_still_names_the_settings_that_accept_it() -> None:
    entry, fails = _failures(0.5, 200.0)  # spread 0.4 %: the error is 0.5x it, over 0.1414x 1 %
    (said,) = fails
    assert "to accept it, set validate.gates.per_precision.int8.max_rel_err" in said, said
    assert "x the spread" not in said, said
