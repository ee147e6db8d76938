"""Float targets that are values per position of an output (an upscaler's images), at data sizes outside the
validated ones, are said unscored for that reason, with the fix to add those sizes, not for a want of an output of
their size (the upscaler's output has it, at the data's own sizes)."""

from __future__ import annotations

import numpy as np
import torch

from kiln.core.data import DatasetSplits, as_feed
from kiln.stages.accuracy.check import held_out, held_out_reference
from kiln.stages.accuracy.config import CheckConfig
from kiln.stages.validate.stage import unscored

AXES = {"input": {2: "h", 3: "w"}}


def _upscale(x: np.ndarray) -> np.ndarray:
    return np.repeat(np.repeat(x, 2, axis=2), 2, axis=3)


def _run(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A x2 upscaler: each pixel repeated 2x2."""
    return {"logits": _upscale(feed["input"])}


def test_upscaled_targets_outside_the_validated_sizes_are_said_unscored_with_the_sizes_fix() -> None:
    x = torch.rand(24, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    y = torch.from_numpy(_upscale(x.numpy()))
    data = DatasetSplits(x[:8], y[:8], x[8:], y[8:])
    feeds = held_out(data, lambda v: as_feed(v, ["input"]), AXES, {"h": [12, 24], "w": [12, 32]}, None)
    ref = held_out_reference(_run, feeds, data, None, CheckConfig(), [1, 4], AXES)
    said = unscored(ref, data)
    assert said is not None and "values per position of output 'logits'" in said
    assert "add the data's sizes to signature.shapes" in said and "no output has as many values" not in said
