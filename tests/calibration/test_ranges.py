"""Calibrated ranges tell a tensor that held no value in any batch (a routed branch no sample takes) apart from one
that is infinite: the first keeps the empty range (+inf, -inf) under every method, the cache included."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kiln.calibration.ranges import calibrate
from tests.calibration.calib_graphs import routed_batches, routed_onnx


@pytest.mark.parametrize(
    "method, symmetric", [("minmax", True), ("minmax", False), ("entropy", True), ("percentile", True)]
)
def test_an_unreached_tensor_is_told_from_an_infinite_one(tmp_path: Path, method: str, symmetric: bool) -> None:
    model = routed_onnx(tmp_path / "m.onnx")
    for hit in (False, True):  # the cached ranges read back tell them apart too
        ranges = calibrate(model, routed_batches(), "x", method, cache_dir=tmp_path, symmetric=symmetric)
        assert ranges.cache_hit is hit
        assert ranges.unbounded() == ["y"], {n: td.range_value for n, td in ranges.tensors.items()}
        assert ranges.unreached() == ["expert", "routed", "z"], {n: td.range_value for n, td in ranges.tensors.items()}
        amax = ranges.amax()
        assert amax["expert"] == np.inf and 0 < amax["logits"] < np.inf, amax  # no scale: left out of a TRT table


def test_a_tensor_empty_in_some_batches_takes_the_others_range(tmp_path: Path) -> None:
    model = routed_onnx(tmp_path / "m.onnx")
    batches = routed_batches()
    batches[1]["x"][3] = 2e6  # one row of one batch is routed
    for method in ("minmax", "percentile"):
        ranges = calibrate(model, batches, "x", method, cache_dir=None)
        assert ranges.unreached() == [] and 0 < ranges.amax()["routed"] < np.inf, ranges.amax()
