"""An input that holds each row's length along a dynamic axis (``lengths [batch]`` beside right-padded ``ids``)
resized with that axis, so validation runs the model on inputs it can receive."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from kiln.core.shapes import axis_sizes, resize, shape_points

AXES = {"ids": {1: "seq"}}


def padded(lengths: list[int], seq: int) -> dict[str, np.ndarray]:
    """Rows of real ids (10 and up) right-padded with 0 to ``seq``, and each row's length."""
    real = np.arange(seq)[None, :] < np.array(lengths)[:, None]
    ids = np.where(real, np.arange(len(lengths) * seq).reshape(-1, seq) + 10, 0)
    return {"ids": ids, "lengths": np.array(lengths, np.int64)}


def test_a_lengths_input_is_clipped_when_its_axis_is_cut() -> None:
    cut = resize(padded([8, 5, 2], 8), AXES, {"seq": 4})
    assert cut["ids"].shape == (3, 4) and cut["lengths"].tolist() == [4, 4, 2]
    assert cut["lengths"].dtype == np.int64
    column = {**padded([8, 5, 2], 8), "seq_len": np.array([[8], [5], [2]], np.int32)}  # [batch, 1] too
    assert resize(column, AXES, {"seq": 4})["seq_len"].tolist() == [[4], [4], [2]]


def test_lengthened_rows_repeat_their_real_positions_and_their_lengths_say_so() -> None:
    """Without an attention mask, the lengths tell where each row's padding starts."""
    data = padded([3, 5], 6)
    longer = resize(data, AXES, {"seq": 15})
    assert longer["ids"][0].tolist() == [10, 11, 12] * 5 and longer["ids"][1].tolist() == [16, 17, 18, 19, 20] * 3
    assert longer["lengths"].tolist() == [15, 15]
    padded_more = resize({**data, "x": np.ones((2, 6), np.float32)}, {**AXES, "x": {1: "seq"}}, {"seq": 8})
    assert padded_more["lengths"].tolist() == [3, 5]  # padding appended at the end: the real positions are as many


def test_lengths_agree_with_the_attention_mask_beside_them() -> None:
    data = padded([3, 5], 6)
    data["attention_mask"] = (data["ids"] != 0).astype(np.int64)
    axes = {**AXES, "attention_mask": {1: "seq"}}
    for size in (2, 4, 6, 9):
        out = resize(data, axes, {"seq": size})
        assert out["lengths"].tolist() == out["attention_mask"].sum(1).tolist(), size


def test_inputs_not_taken_for_lengths_are_left_as_they_are() -> None:
    data = padded([8, 5], 8)
    data |= {
        "count": np.array([8, 5]),  # not named like lengths
        "frac_len": np.array([0.5, 0.25], np.float32),  # not integers
        "max_len": np.array([8, 64]),  # beyond the axis: not each row's length along it
        "grid_len": np.ones((2, 3), np.int64),  # not one value per row
    }
    out = resize(data, AXES, {"seq": 4})
    assert out["lengths"].tolist() == [4, 4]
    for name in ("count", "frac_len", "max_len", "grid_len"):
        assert np.array_equal(out[name], data[name]), name
    # two axes the lengths fit: which one they measure is not known, so they stay
    two = {"src": np.ones((2, 8), np.int64), "tgt": np.ones((2, 6), np.int64), "lengths": np.array([5, 3])}
    assert resize(two, {"src": {1: "s"}, "tgt": {1: "t"}}, {"s": 2, "t": 2})["lengths"].tolist() == [5, 3]


class Packed(nn.Module):
    """An LSTM over right-padded ids that reads each row up to its length (``pack_padded_sequence``)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 4, padding_idx=0)
        self.lstm = nn.LSTM(4, 5, batch_first=True)

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(self.emb(ids), lengths, batch_first=True, enforce_sorted=False)
        return self.lstm(packed)[1][0][-1]


def test_a_packed_lstm_runs_at_every_size_validation_checks() -> None:
    """The sizes the export and validation run (half the data's length and beyond it) are inputs the model takes."""
    torch.manual_seed(0)
    model, data = Packed().eval(), padded([20, 7, 3, 12], 20)
    data["ids"] %= 64
    points = shape_points(axis_sizes([data], AXES, {})) + shape_points(axis_sizes([data], AXES, {"seq": [30]}))
    assert [p["seq"] for p in points] == [10, 20, 30]
    for point in points:
        feed = resize(data, AXES, point)
        with torch.no_grad():
            out = model(torch.from_numpy(feed["ids"]), torch.from_numpy(feed["lengths"]))
        assert out.shape == (4, 5) and torch.isfinite(out).all(), point
