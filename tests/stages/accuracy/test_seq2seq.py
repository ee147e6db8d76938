"""An encoder-decoder's outputs and labels follow the decoder's axis, also where the source and the target have one
length: the encoder's attention mask does not hide decoder positions from the comparison, and labels per position
follow ``decoder_input_ids``, not the first input of their shape."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from kiln.core.data import DatasetSplits, as_feed
from kiln.core.labels import IGNORE_LABEL
from kiln.core.shapes import resize
from kiln.stages.accuracy.check import Reference, compare_on, held_out, held_out_reference, labels_at_points
from kiln.stages.accuracy.config import CheckConfig

VOCAB, L = 12, 8
NAMES = ["input_ids", "attention_mask", "decoder_input_ids"]
AXES = {"input_ids": {1: "enc"}, "attention_mask": {1: "enc"}, "decoder_input_ids": {1: "dec"}}


class _Seq2Seq(torch.nn.Module):
    """Decoder logits [N, dec, V]: each target token's embedding plus the mean of the source's real tokens."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, VOCAB)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, dec: torch.Tensor) -> torch.Tensor:
        m = attention_mask[..., None].float()
        src = (self.emb(input_ids) * m).sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1)
        return self.head(self.emb(dec) + src)


def _data() -> DatasetSplits:
    """Sources of 2..4 tokens padded to L, targets the source twice (4..8 tokens), decoders padded to L too."""
    g = torch.Generator().manual_seed(0)
    n = torch.randint(2, L // 2 + 1, (48,), generator=g)
    mask = (torch.arange(L) < n[:, None]).long()
    ids = torch.randint(2, VOCAB, (48, L), generator=g) * mask
    tgt = torch.cat([ids[:, : L // 2], ids[:, : L // 2]], 1)
    for i, k in enumerate(n.tolist()):
        tgt[i, : 2 * k] = torch.cat([ids[i, :k], ids[i, :k]])
    labels = tgt.masked_fill(torch.arange(L) >= 2 * n[:, None], IGNORE_LABEL)
    dec = torch.zeros_like(tgt)
    dec[:, 1:] = tgt[:, :-1]
    x = {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": dec}
    return DatasetSplits(
        {k: v[:16] for k, v in x.items()},
        labels[:16],
        {k: v[16:] for k, v in x.items()},
        labels[16:],
        num_classes=VOCAB,
    )


def _run(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    model = _Seq2Seq().eval()
    with torch.no_grad():
        return {"logits": model(*(torch.from_numpy(feed[k]) for k in NAMES)).numpy()}


def _late_wrong(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """An engine wrong only at decoder positions from 4 on: labelled target tokens where every source is padding."""
    out = _run(feed)["logits"].copy()
    out[:, 4:] += 10.0
    return {"logits": out}


def _reference(shapes: dict[str, list[int]], **kw: Any) -> Reference:
    data = _data()
    feeds = held_out(data, lambda v: as_feed(v, NAMES), AXES, shapes, None)
    return held_out_reference(_run, feeds, data, "logits", CheckConfig(), [1, 8], AXES, **kw)


def test_labels_follow_the_decoder_input_at_every_validated_shape() -> None:
    """enc and dec both 4..8: labels [N, 8] are cut and padded as decoder_input_ids is at each shape, so accuracy
    is measured. Before: they followed input_ids (the first input of their shape), did not fit the logits at
    dec=4, enc=8, and were dropped at every shape (no accuracy gate)."""
    data, ref = _data(), _reference({})
    assert [p for p, _ in ref.feeds] == [
        {"dec": 4, "enc": 4},
        {"dec": 4, "enc": 8},
        {"dec": 8, "enc": 4},
        {"dec": 8, "enc": 8},
    ]
    y = data.val_y.numpy()
    for (point, _), labels in zip(ref.feeds, ref.point_labels):
        assert labels is not None and np.array_equal(labels, y[:, : point["dec"]])
    assert ref.accuracy is not None and ref.output_axes == {"logits": {1: "dec"}}


def test_labels_tied_between_inputs_on_two_axes_are_kept_only_where_both_agree() -> None:
    """Where no class logits say which axis labels follow, two inputs of their shape on the axes enc and dec tie:
    the labels are kept at the shapes where both give the same labels, not guessed at the others."""
    feed = {k: v.numpy() for k, v in _data().val_x.items()}
    y = _data().val_y.numpy()
    points = [{"dec": 4, "enc": 8}, {"dec": 8, "enc": 8}]
    feeds = [(p, resize(feed, AXES, p)) for p in points]
    tied, same = labels_at_points(y, feed, feeds, AXES)
    assert tied is None and np.array_equal(same, y)
    short, _ = labels_at_points(y, feed, feeds, AXES, {1: "dec"})
    assert np.array_equal(short, y[:, :4])


def test_decoder_positions_are_compared_where_the_source_is_padding(caplog: pytest.LogCaptureFixture) -> None:
    """Validated at enc = dec = 8 only: an engine wrong at the late decoder positions, where every source is
    padding, fails. Before: the encoder's attention mask, shaped like the logits' first two axes, hid them
    (cosine 1.0). Without names for the logits' axes the tie is said; with them (``output_axes``) it is not."""
    with caplog.at_level("WARNING", logger="kiln.validate"):
        ref = _reference({"enc": [8], "dec": [8]})
    assert "'attention_mask' and 'decoder_input_ids'" in caplog.text
    assert compare_on(ref, _late_wrong, [1, 8]).stats["logits"].cosine < 0.9
    assert compare_on(ref, _run, [1, 8]).stats["logits"].cosine == pytest.approx(1.0)
    caplog.clear()
    with caplog.at_level("WARNING", logger="kiln.validate"):
        ref = _reference({"enc": [8], "dec": [8]}, output_axes={"logits": {1: "dec"}})
    assert "attention_mask" not in caplog.text and ref.accuracy is not None
    assert compare_on(ref, _late_wrong, [1, 8]).stats["logits"].cosine < 0.9


def test_labels_that_miss_the_logits_at_one_shape_are_kept_where_they_fit(caplog: pytest.LogCaptureFixture) -> None:
    """Labels that fit the class logits at the scored shape but not at another are left out at that one only:
    the scored shape keeps its accuracy."""
    rng = np.random.default_rng(0)
    logits = {n: rng.standard_normal((1, n, 5)).astype(np.float32) for n in (4, 8)}
    feeds = [({"dec": n}, {"x": np.zeros((4, n), np.int64)}) for n in (4, 8)]
    labels = [np.zeros((4, 8), np.int64), np.zeros((4, 8), np.int64)]

    def run(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"logits": np.repeat(logits[feed["x"].shape[1]], len(feed["x"]), 0)}

    with caplog.at_level("WARNING", logger="kiln.validate"):
        ref = Reference(run, feeds, labels, "logits", 4)
    assert ref.point_labels[0] is None and ref.point_labels[1] is labels[1] and ref.accuracy is not None
    assert "dec=4" in caplog.text
