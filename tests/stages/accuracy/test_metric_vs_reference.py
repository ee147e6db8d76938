"""validate.metric on data without labels (a generator's latents): a metric of the user's scores each engine's
outputs against the reference's, the reference's own score the baseline max_metric_drop holds the drop from."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.core.data import DatasetSplits, as_feed
from kiln.core.errors import ModelError
from kiln.stages.accuracy.check import Reference, held_out, held_out_reference
from kiln.stages.accuracy.config import CheckConfig
from tests.stages.accuracy.judging import judged

W = np.random.default_rng(1).standard_normal((8, 3 * 8 * 8))


def image(z: np.ndarray) -> np.ndarray:
    """A saturated tanh image [N, 3, 8, 8] of latents ``z`` [N, 8]: most pixels near -1 or 1."""
    return np.tanh(2.0 * z @ W).reshape(len(z), 3, 8, 8)


def close_share(outputs: dict[str, np.ndarray], labels: dict[str, np.ndarray]) -> float:
    """The share of pixels within 0.1 of the reference's (its outputs are the labels)."""
    return float(np.mean(np.abs(outputs["image"] - labels["image"]) <= 0.1))


def reference(metric: str) -> Reference:
    z = torch.from_numpy(np.random.default_rng(0).standard_normal((64, 8)).astype(np.float32))
    data = DatasetSplits(z[:32], None, z[32:], None)
    feeds = held_out(data, lambda v: as_feed(v, ["z"]), {}, {}, None)
    cfg = CheckConfig(metric=metric)
    return held_out_reference(lambda feed: {"image": image(feed["z"])}, feeds, data, None, cfg, [1, 8], {})


def test_a_metric_without_labels_scores_the_engines_against_the_reference() -> None:
    """An INT8 engine that moves 3 % of the pixels by 0.4 keeps its cosine and relative error within their INT8
    gates; the share of pixels close to PyTorch's, which the user asks for, fails it. Without labels the metric was
    refused ("needs labels, and the data has none")."""
    ref = reference(f"{__name__}:close_share")
    assert ref.metric_value == 1.0  # the reference against itself

    def off(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        img = image(feed["z"])
        return {"image": img - 0.4 * np.sign(img) * (np.sin(1e3 * img) > 0.985)}  # about 3 % of the pixels

    entry, failures = judged(ref, off, [1, 8], "int8", CheckConfig(metric=f"{__name__}:close_share"))
    assert failures == [
        f"{__name__}:close_share {entry.metric:.4g} vs 1: drop {1 - entry.metric:.4g} > max_metric_drop 0.01"
    ], failures
    assert 0.95 < entry.metric < 0.99
    close = lambda feed: {"image": image(feed["z"]) + 1e-3}  # noqa: E731
    assert judged(ref, close, [1, 8], "int8", CheckConfig(metric=f"{__name__}:close_share"))[1] == []


def test_a_built_in_metric_without_labels_says_both_fixes() -> None:
    with pytest.raises(ModelError, match="'mse' needs labels, and the data has none") as err:
        reference("mse")
    assert "a metric of your own (pkg.mod:fn)" in err.value.hint and "against the reference's" in err.value.hint


def psnr_uncapped(outputs: dict[str, np.ndarray], labels: dict[str, np.ndarray]) -> float:
    with np.errstate(divide="ignore"):
        return float(10 * np.log10(4 / np.mean((outputs["image"] - labels["image"]) ** 2)))


def wrong_name(outputs: dict[str, np.ndarray], labels: dict[str, np.ndarray]) -> float:
    return float(np.mean(outputs["image"] - labels["pixels"]))


def test_a_metric_that_fails_on_the_reference_says_what_it_was_given() -> None:
    """A PSNR of the reference against itself is infinite: the fix says to cap it; a metric reading an output the
    reference lacks is told the outputs it was given as labels."""
    with pytest.raises(ModelError, match="returned inf on outputs .* against the reference's outputs") as err:
        reference(f"{__name__}:psnr_uncapped")
    assert "cap it" in err.value.hint
    with pytest.raises(ModelError, match=r"the reference's outputs \{image: \[32, 3, 8, 8\]\}") as err:
        reference(f"{__name__}:wrong_name")
    assert "KeyError" in str(err.value) and "dict of name -> the reference's array" in err.value.hint
