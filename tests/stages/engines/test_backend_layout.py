"""check_feed: an NHWC image given to an NCHW engine is told to transpose it, not to make the channels dynamic."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.core.errors import InputError
from kiln.core.records import EngineMetadata, TensorSpec
from kiln.stages.engines.backend import check_feed


def _meta() -> EngineMetadata:
    spec = TensorSpec(name="pixel_values", shape=["batch", 3, 32, 32], dtype="float32")
    return EngineMetadata.model_construct(name="swin", inputs=[spec], index_ranges={}, index_floors={})


def test_an_nhwc_image_is_told_the_transpose_the_engine_takes() -> None:
    image = np.zeros((1, 32, 32, 3), np.float32)
    with pytest.raises(InputError) as err:
        check_feed(_meta(), {"pixel_values": image})
    assert str(err.value).startswith(
        "input 'pixel_values' axis 1 is 32: engine swin takes 3 there (a fixed size of its graph); it looks like NHWC, "
        "and the engine takes NCHW: x.transpose(0, 3, 1, 2)"
    )
    assert err.value.hint == "pass 'pixel_values' with its axes in the engine's order: x.transpose(0, 3, 1, 2)"
    assert "dynamic_axes" not in err.value.hint


def test_a_size_no_order_gives_keeps_the_fixed_size_fix() -> None:
    with pytest.raises(InputError) as err:
        check_feed(_meta(), {"pixel_values": np.zeros((1, 4, 32, 32), np.float32)})
    assert "transpose" not in str(err.value) and "signature.dynamic_axes" in err.value.hint
