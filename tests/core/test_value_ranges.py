"""Each float input's recorded value range (kiln-engine.json's ``value_ranges``): read back where present, absent
from older records, refused where it cannot be a range, and the range random inputs are drawn in."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.core.errors import InputFileError
from kiln.core.inputs import float_ranges, random_inputs
from kiln.core.records import EngineMetadata, TensorSpec

SPECS = [
    TensorSpec(name="image", shape=["batch", 3, 4, 4], dtype="float32"),
    TensorSpec(name="features", shape=["batch", 5], dtype="float16"),
    TensorSpec(name="noise", shape=["batch", 5], dtype="float32"),
    TensorSpec(name="ids", shape=["batch", 6], dtype="int64"),
]


def _record(**extra: object) -> dict:
    """A kiln-engine.json as an older Kiln wrote it (no value_ranges), with ``extra`` keys."""
    spec = {"name": "x", "shape": ["batch", 4], "dtype": "float32"}
    return {
        "name": "onnxruntime-cpu-int8",
        "backend": "onnxruntime",
        "device": "cpu",
        "precision": "int8",
        "inputs": [spec],
        "outputs": [{**spec, "name": "y"}],
        "source": {"file": "model.onnx", "sha256": "0"},
        "files": {"model": "engine.onnx"},
        "flavour": "cpu",
        "versions": {},
        **extra,
    }


def test_value_ranges_are_read_back_and_older_records_still_load() -> None:
    assert EngineMetadata.parse(_record(), "old", "fix").value_ranges == {}
    meta = EngineMetadata.parse(_record(value_ranges={"x": [0, 1]}), "new", "fix")
    assert meta.value_ranges == {"x": [0.0, 1.0]}
    assert EngineMetadata.model_validate_json(meta.model_dump_json()).value_ranges == {"x": [0.0, 1.0]}


@pytest.mark.parametrize("bad", [[1, 0], [0], [0, 1, 2], [0, float("inf")], [float("nan"), 1]])
def test_a_range_that_is_none_is_refused_as_a_bad_record(bad: list[float]) -> None:
    with pytest.raises(InputFileError, match="value_ranges.x"):
        EngineMetadata.parse(_record(value_ranges={"x": bad}), "kiln-engine.json", "fix")


def test_random_floats_lie_in_their_recorded_range_and_others_stay_normal() -> None:
    ranges = {"image": [0.0, 1.0], "features": [2.0, 3.0]}
    feed = random_inputs(SPECS, batch=16, float_ranges=ranges, int_ranges={"ids": [5, 9]})
    image, features = feed["image"], feed["features"]
    assert image.dtype == np.float32 and 0 <= image.min() and image.max() <= 1 and image.std() > 0.2
    assert features.dtype == np.float16 and 2 <= features.min() and features.max() <= 3
    assert feed["noise"].min() < 0 < feed["noise"].max()  # none recorded: N(0, 1) as before
    assert 5 <= feed["ids"].min() and feed["ids"].max() <= 9


def test_float_ranges_are_each_float_inputs_finite_extremes() -> None:
    feed = {
        "image": np.array([[0.25, np.nan], [0.75, np.inf]], np.float32),
        "ids": np.array([[3, 4]]),
        "empty": np.zeros((0, 3), np.float32),
        "nan": np.full((2, 2), np.nan, np.float32),
    }
    assert float_ranges(feed) == {"image": [0.25, 0.75]}
