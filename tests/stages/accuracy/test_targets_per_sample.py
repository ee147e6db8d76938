"""Integer labels of several targets per sample (a multi-task text model's ``[N, 2]``: a topic and a sentiment
class) beside pooled class logits: scored like labels one per row, at validated lengths other than the data's."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from kiln.core.data import DatasetSplits, as_feed
from kiln.core.errors import ModelError
from kiln.core.outputs import flatten_outputs
from kiln.stages.accuracy.check import Reference, held_out, held_out_reference
from kiln.stages.accuracy.config import CheckConfig
from tests.stages.train.test_train_targets_per_sample import MultiTask

AXES = {"tokens": {1: "seq"}, "padding_mask": {1: "seq"}}


def both_heads(outputs: dict[str, np.ndarray], labels: np.ndarray) -> float:
    """validate.metric of the two heads: the mean of their accuracies, each on its own column of the labels."""
    topic = (outputs["heads.topic"].argmax(-1) == labels[:, 0]).mean()
    sentiment = (outputs["heads.sentiment"].argmax(-1) == labels[:, 1]).mean()
    return float((topic + sentiment) / 2)


def _data() -> DatasetSplits:
    """64 texts of 16 tokens (the last 6 padding in every other one), labelled (topic, sentiment)."""
    g = torch.Generator().manual_seed(0)
    tokens, mask = torch.randint(1, 20, (64, 16), generator=g), torch.zeros(64, 16, dtype=torch.bool)
    mask[::2, 10:] = True
    y = torch.stack([torch.randint(0, 5, (64,), generator=g), torch.randint(0, 3, (64,), generator=g)], 1)
    x = {"tokens": tokens.masked_fill(mask, 0), "padding_mask": mask}
    return DatasetSplits({k: v[:32] for k, v in x.items()}, y[:32], {k: v[32:] for k, v in x.items()}, y[32:], 5)


def _reference(metric: str | None, shapes: dict[str, list[int]], named: bool = True) -> Reference:
    """The reference of the multi-task model validated at ``shapes``, its topic head named as the class logits."""
    data, model = _data(), MultiTask().eval()

    def run(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with torch.no_grad():
            out = model(torch.from_numpy(feed["tokens"]), torch.from_numpy(feed["padding_mask"]))
        return {k: v.numpy() for k, v in flatten_outputs(out).items()}

    feeds = held_out(data, lambda v: as_feed(v, ["tokens", "padding_mask"]), AXES, shapes, None)
    return held_out_reference(run, feeds, data, "heads.topic", CheckConfig(metric=metric), [1, 8], AXES, named=named)


def test_targets_per_sample_are_scored_at_validated_lengths_the_data_lacks(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lengths 5 and 9 beside data 16 long: labels one row per sample fit every length, so validate.metric is
    measured at the last (said as a warning: the texts there are cut), not left unmeasured as labels per position
    of the data's own length would be."""
    monkeypatch.setattr(logging.getLogger("kiln"), "propagate", True)  # the CLI tests turn it off
    caplog.set_level(logging.WARNING, logger="kiln")
    ref = _reference(f"{__name__}:both_heads", {"seq": [5, 9]})
    assert ref.score == len(ref.feeds) - 1 and ref.feeds[ref.score][0] == {"seq": 9}
    assert ref.metric_value == pytest.approx(both_heads(ref.outputs[ref.score], ref.targets))
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "per position" not in said and "measured at seq=9" in said, said


@pytest.mark.parametrize("metric", [None, f"{__name__}:both_heads"])
def test_labels_the_named_logits_do_not_take_are_said_in_a_whole_sentence(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, metric: str | None
) -> None:
    """The warning says which output top-1 agreement holds, and points to validate.metric only where none is set."""
    monkeypatch.setattr(logging.getLogger("kiln"), "propagate", True)
    caplog.set_level(logging.WARNING, logger="kiln")
    ref = _reference(metric, {})
    assert ref.accuracy is None and (ref.metric_value is None) == (metric is None)
    said = [r.getMessage() for r in caplog.records if "no task accuracy is measured on them" in r.getMessage()]
    assert len(said) == 1 and "output 'heads.topic' is held to top-1 agreement with the reference" in said[0]
    assert ("validate.metric" in said[0]) == (metric is None), said


def test_targets_per_sample_beside_logits_no_setting_names_get_a_fix_naming_the_metric() -> None:
    """Where the class logits are taken by default (signature.logits_output unset), labels that do not fit them stay
    an error: its fix says that several targets per sample are validate.metric's to score."""
    with pytest.raises(ModelError, match=r"labels int64\[32, 2\] do not fit") as caught:
        _reference(None, {}, named=False)
    assert "validate.metric" in caught.value.hint and "signature.logits_output" in caught.value.hint
