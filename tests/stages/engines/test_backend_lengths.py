"""check_feed: a lengths input longer than the axis it measures is refused naming it, not by a node of the graph."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.core.errors import InputError
from kiln.core.records import EngineMetadata, TensorSpec
from kiln.stages.engines.backend import LENGTHS_HINT, check_feed


def test_lengths_past_the_frames_are_refused_unless_outside_ranges_are_allowed() -> None:
    inputs = [
        TensorSpec(name="features", shape=["batch", "frames", 80], dtype="float32"),
        TensorSpec(name="lengths", shape=["batch"], dtype="int64"),
    ]
    meta = EngineMetadata.model_construct(name="conf", inputs=inputs, index_ranges={}, index_floors={})
    feed = {"features": np.zeros((2, 40, 80), np.float32), "lengths": np.array([64, 30])}
    with pytest.raises(InputError, match="'lengths' holds 64 at row 0: longer than the 40 positions") as err:
        check_feed(meta, feed)
    assert err.value.hint == LENGTHS_HINT
    check_feed(meta, feed, allow_outside_ranges=True)
    check_feed(meta, {"features": feed["features"], "lengths": np.array([40, 0])})
