"""EngineMetadata.refusal: a server's refusal of an NHWC image names the transpose the engine takes."""

from __future__ import annotations

import numpy as np

from kiln.core.feeds import reordered
from kiln.core.records import EngineMetadata, TensorSpec


def test_a_server_refusal_of_an_nhwc_image_names_the_transpose() -> None:
    spec = TensorSpec(name="pixel_values", shape=["batch", 3, "h", "w"], dtype="float32")
    meta = EngineMetadata.model_construct(name="swin", inputs=[spec], index_ranges={}, index_floors={})
    refusal = meta.refusal({"pixel_values": np.zeros((2, 40, 48, 3), np.float32)})
    assert refusal is not None and refusal.endswith(
        "it looks like NHWC, and the engine takes NCHW: x.transpose(0, 3, 1, 2)"
    )


def test_reordered_finds_the_order_or_none() -> None:
    assert reordered((1, 3, 8, 8), [None, 8, 8, 3], "the model") == (
        "it looks like NCHW, and the model takes NHWC",
        "x.transpose(0, 2, 3, 1)",
    )
    assert reordered((1, 4, 8, 8), [None, 3, 8, 8], "the model") is None


def test_the_rows_are_not_moved_to_a_fixed_size_they_match_by_chance() -> None:
    """64 rows of 48 frames where the model takes 64 frames: the frames are wrong, no transpose makes them right."""
    assert reordered((64, 16, 48), [None, 16, 64], "the model") is None
    # the rows may still move to an axis of any size
    assert reordered((4, 7, 16), [16, None, None], "the model") == (
        "its axes are in another order",
        "x.transpose(2, 0, 1)",
    )
