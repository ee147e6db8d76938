"""length_axes and overlong_lengths: a row's length past the axis it measures is refused."""

from __future__ import annotations

import numpy as np

from kiln.core.feeds import length_axes, overlong_lengths
from kiln.core.records import TensorSpec

FEATURES = TensorSpec(name="features", shape=["batch", "frames", 80], dtype="float32")
LENGTHS = TensorSpec(name="lengths", shape=["batch"], dtype="int64")


def test_lengths_measure_the_one_named_axis_beside_them() -> None:
    assert length_axes([FEATURES, LENGTHS]) == {"lengths": ("features", 1, "frames")}
    tokens = TensorSpec(name="tokens", shape=["batch", "tokens"], dtype="int64")
    assert length_axes([FEATURES, LENGTHS, tokens]) == {}  # frames or tokens: not known
    counts = TensorSpec(name="counts", shape=["batch"], dtype="int64")
    assert length_axes([FEATURES, counts]) == {}  # not named like lengths
    assert length_axes([FEATURES, TensorSpec(name="lengths", shape=["batch"], dtype="float32")]) == {}


def test_a_length_past_the_frames_of_the_call_is_refused_and_0_is_left_to_the_model() -> None:
    features = np.zeros((2, 40, 80), np.float32)
    assert overlong_lengths([FEATURES, LENGTHS], {"features": features, "lengths": np.array([40, 0])}) is None
    expected = (
        "input 'lengths' holds 64 at row 0: longer than the 40 positions of input 'features' axis 1 (frames) in this "
        "call, the axis it measures"
    )
    assert overlong_lengths([FEATURES, LENGTHS], {"features": features, "lengths": np.array([64, 30])}) == expected
