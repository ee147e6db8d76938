"""The shapes validation runs at: sizes of each dynamic axis, the points, and resizing real inputs to them."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.core.errors import ConfigError
from kiln.core.records import TensorSpec
from kiln.core.shapes import axis_sizes, graph_axes, resize, shape_points

AXES = {"ids": {1: "seq"}, "mask": {1: "seq"}}


def feed(seq: int) -> dict[str, np.ndarray]:
    return {"ids": np.arange(2 * seq).reshape(2, seq) + 1, "mask": np.ones((2, seq), np.int64)}


def test_sizes_from_the_data_or_the_config() -> None:
    assert axis_sizes([feed(16)], AXES, {}) == {"seq": [8, 16]}  # one size in the data: half and all of it
    assert axis_sizes([feed(12), feed(16)], AXES, {}) == {"seq": [12, 16]}
    assert axis_sizes([feed(16)], AXES, {"seq": [32, 4]}) == {"seq": [4, 32]}
    with pytest.raises(ConfigError, match="signature.shapes names axes \\['len'\\]"):
        axis_sizes([feed(16)], AXES, {"len": [4]})
    assert shape_points({"seq": [8, 16]}) == [{"seq": 8}, {"seq": 16}] and shape_points({}) == [{}]
    # two axes: paired, plus each at its smallest beside the other's largest (a decode step: 1 new token, 32 past),
    # the largest together last
    assert shape_points({"new": [1, 4], "past": [1, 32]}) == [
        {"new": 1, "past": 1},
        {"new": 1, "past": 32},
        {"new": 4, "past": 1},
        {"new": 4, "past": 32},
    ]


def test_resize_cuts_or_zero_pads_every_tied_axis() -> None:
    short, long = resize(feed(16), AXES, {"seq": 4}), resize(feed(16), AXES, {"seq": 20})
    assert short["ids"].shape == short["mask"].shape == (2, 4) and (short["ids"] == feed(16)["ids"][:, :4]).all()
    assert long["mask"].shape == (2, 20) and not long["mask"][:, 16:].any() and long["mask"][:, :16].all()


def test_graph_axes_are_the_symbolic_dims_after_batch() -> None:
    specs = [
        TensorSpec(name="ids", shape=["batch", "seq"], dtype="int64"),
        TensorSpec(name="x", shape=["b", 3], dtype="float32"),
    ]
    assert graph_axes(specs) == {"ids": {1: "seq"}}


def test_a_float_input_lengthened_for_validation_repeats_itself_and_an_integer_one_takes_zeros() -> None:
    """Audio made longer by silence, a point cloud by points at the origin: inputs the data never held, on which
    gates judged engines (an INT8 Wav2Vec2 dropped for clips three quarters silent)."""
    from kiln.core.shapes import resize

    feed = {"audio": np.array([[1.0, 2.0, 3.0]], np.float32), "ids": np.array([[5, 6, 7]], np.int64)}
    axes = {"audio": {1: "t"}, "ids": {1: "t"}}
    longer = resize(feed, axes, {"t": 7}, repeat_floats=True)
    assert longer["audio"].tolist() == [[1, 2, 3, 1, 2, 3, 1]] and longer["ids"].tolist() == [[5, 6, 7, 0, 0, 0, 0]]
    assert resize(feed, axes, {"t": 5})["audio"].tolist() == [[1, 2, 3, 0, 0]]  # the default: zeros, as before
    assert resize(feed, axes, {"t": 2}, repeat_floats=True)["audio"].tolist() == [[1, 2]]
