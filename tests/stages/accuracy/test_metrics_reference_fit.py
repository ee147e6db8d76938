"""An error metric's drop where the reference predicts worse than the targets' mean, and a metric that returns text."""

from __future__ import annotations

import re

import numpy as np
import pytest

from kiln.core.errors import ModelError
from kiln.stages.accuracy.metrics import Metric, resolve_metric, scaled_by


def _offset() -> tuple[Metric, float]:
    """``mse`` of targets offset by -1000 (variance ~1), and the MSE of a model that never fit them (predicting 0)."""
    y = np.random.default_rng(0).normal(size=200) - 1000.0
    return scaled_by(resolve_metric("mse", None), y), float(np.mean(y**2))


def test_a_reference_worse_than_the_targets_mean_is_judged_over_its_own_error() -> None:
    """The model's MSE (~1e6) dwarfs the targets' variance (~1), and an engine's rounding of its predictions (a rise
    of 2 in MSE) read as 2 of R^2 lost, failing any gate. Over the reference's own MSE it is a rise of 2e-6."""
    mse, reference = _offset()
    assert mse.drop(reference, reference + 2.0) == pytest.approx(2.0 / reference)
    # a reference that fits better than the mean keeps the targets' variance as the scale
    assert mse.drop(0.5 * mse.scale, 0.51 * mse.scale) == pytest.approx(0.01)


def test_a_reference_worse_than_the_targets_mean_is_warned_of() -> None:
    from kiln.stages.accuracy.metrics import worse_than_mean_note

    mse, reference = _offset()
    note = worse_than_mean_note(mse, reference)
    assert note is not None and "exceeds the targets' variance" in note and "< 0)" in note, note
    assert worse_than_mean_note(mse, 0.5 * mse.scale) is None


@pytest.mark.parametrize("name", ["mse", "rmse"])
def test_a_reference_just_worse_than_the_mean_reads_as_worse(name: str) -> None:
    """An all-zero model's MSE is the targets' mean square, just over their variance: the two numbers are shown
    with digits enough to differ, and R^2 itself."""
    from kiln.stages.accuracy.metrics import worse_than_mean_note

    y = np.random.default_rng(0).normal(size=100_000)
    y = (y - y.mean()) / y.std() + 0.01  # variance 1, mean 0.01: the zero model's MSE is 1.0001
    metric = scaled_by(resolve_metric(name, None), y)
    reference = float(np.mean(y**2)) if name == "mse" else float(np.sqrt(np.mean(y**2)))
    note = worse_than_mean_note(metric, reference) or ""
    said, scale = re.search(r"reference's \w+ \((\S+)\) exceeds the targets' [\w ]+ \((\S+)\)", note).groups()
    assert said != scale and float(said) > float(scale), note
    assert "(R^2 = -0.0001 < 0)" in note, note


@pytest.mark.parametrize("returned", ["0.5", b"0.5", np.array("0.5")], ids=["str", "bytes", "str-array"])
def test_a_metric_returning_text_is_refused(returned: object) -> None:
    """NumPy reads "0.5" as 0.5: a metric returning text scored it as a number."""
    outputs, labels = {"logits": np.zeros((4, 3), np.float32)}, np.zeros(4, np.int64)
    with pytest.raises(ModelError, match=r"validate.metric 'mine:text' returned .*, not a float"):
        Metric("mine:text", lambda out, y: returned)(outputs, labels)
