"""Validation holds each output to the shape its engine declares (what Triton and the server hold it to)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from kiln.core.records import TensorSpec
from kiln.stages.validate.stage import declared_shape_problems


def test_validation_holds_outputs_to_their_declared_shapes() -> None:
    meta = SimpleNamespace(  # the two fields of EngineMetadata it reads
        inputs=[TensorSpec(name="x", shape=["batch", "seq", 4], dtype="float32")],
        outputs=[
            TensorSpec(name="steps", shape=["batch", 48, 6], dtype="float32"),
            TensorSpec(name="logits", shape=["batch", 3], dtype="float32"),
        ],
    )
    feed = {"x": np.zeros((2, 24, 4), np.float32)}
    got = {"steps": np.zeros((2, 24, 6)), "logits": np.zeros((2, 3))}
    assert declared_shape_problems(meta, feed, got) == [
        "output 'steps' is declared ['batch', 48, 6], the engine returned [2, 24, 6]"
    ]
    meta.outputs[0].shape[1] = "seq"
    assert declared_shape_problems(meta, feed, got) == []
    assert declared_shape_problems(meta, feed, {**got, "logits": np.zeros((3, 3))})  # batch is the inputs' batch


def test_a_name_the_inputs_give_two_sizes_holds_the_output_to_nothing() -> None:
    meta = SimpleNamespace(
        inputs=[
            TensorSpec(name="images", shape=["batch", 3], dtype="float32"),
            TensorSpec(name="texts", shape=["batch", 5], dtype="int64"),
        ],
        outputs=[TensorSpec(name="logits_per_image", shape=["batch", "batch"], dtype="float32")],
    )
    feed = {"images": np.zeros((16, 3)), "texts": np.zeros((4, 5))}
    assert declared_shape_problems(meta, feed, {"logits_per_image": np.zeros((16, 4))}) == []
