"""A TensorRT profile spans an axis declared from 0 (a decoder's empty past): TensorRT takes empty tensors, so the
profile starts there, while its batch axis still starts at 1 (signature.shapes refuses a batch of 0)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kiln.core.records import TensorSpec
from kiln.stages.engines.tensorrt.config import ShapeRange
from kiln.stages.engines.tensorrt.profiles import default_profiles


def test_a_profile_spans_an_axis_declared_from_0() -> None:
    specs = [TensorSpec(name="past", shape=["batch", "past", 8], dtype="float32")]
    (profile,) = default_profiles(specs, 4, {"past": [0, 16]})
    assert profile["past"].model_dump() == {"min": [1, 0, 8], "opt": [4, 16, 8], "max": [4, 16, 8]}


def test_a_profile_takes_no_negative_size() -> None:
    with pytest.raises(ValidationError, match="shape dims must be >= 0"):
        ShapeRange(min=[1, -1, 8], opt=[4, 16, 8], max=[4, 16, 8])
