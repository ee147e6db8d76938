"""An integer ``[N]`` input that holds each row's length along an axis but is not named like lengths (a conformer's
``n_frames``) is left as it is when the axis is resized: a warning names it and the rule."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from kiln.core.shapes import axis_sizes, resize, unnamed_lengths

AXES = {"features": {1: "frames"}}


def _feed(counts: list[int], frames: int = 8) -> dict[str, np.ndarray]:
    return {"features": np.ones((len(counts), frames, 2), np.float32), "n_frames": np.array(counts, np.int64)}


def test_an_unnamed_lengths_input_is_warned_of_when_its_axis_is_resized(caplog: pytest.LogCaptureFixture) -> None:
    train, held_out = _feed([8, 5, 4]), _feed([7, 5, 6])  # only the training split reaches the size
    with caplog.at_level(logging.WARNING, logger="kiln"):
        sizes = axis_sizes([train, held_out], AXES, {})
    assert sizes == {"frames": [4, 8]}
    assert resize(held_out, AXES, {"frames": 4})["n_frames"].tolist() == [7, 5, 6]  # left as it is, and said
    (record,) = [r for r in caplog.records if "n_frames" in r.getMessage()]
    assert "along axis frames" in record.getMessage() and "end in len, lens, length or lengths" in record.getMessage()


def test_only_row_counts_reaching_the_axis_size_look_like_lengths() -> None:
    labels = ["frames"]
    assert unnamed_lengths([_feed([8, 5, 3])], AXES, labels) == {"n_frames": "frames"}
    assert unnamed_lengths([_feed([7, 5, 3])], AXES, labels) == {}  # no row reaches the size: class ids?
    assert unnamed_lengths([_feed([8, 0, 3])], AXES, labels) == {}  # outside 1..size
    assert unnamed_lengths([_feed([8, 5, 3]), _feed([9, 5, 3])], AXES, labels) == {}  # past the size in a split
    named = {**_feed([8, 5, 3]), "lengths": np.array([8, 5, 3])}  # length_inputs' own
    assert unnamed_lengths([named], AXES, labels) == {"n_frames": "frames"}
