"""Random uint8 inputs that index no table are images' pixels over 0..255: at 0 and 1 alone an image is black, its
outputs barely vary between samples, and the precision variants checked on them fail by an error over that tiny
spread. Where nothing tells whether a uint8 input indexes a table, it gets ids 0 and 1 as other integers do."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kiln.core.inputs import random_inputs
from kiln.core.records import TensorSpec
from kiln.pipeline.config import config_from_dict
from kiln.pipeline.runner import settings_for
from kiln.pipeline.stage_list import stage_named
from kiln.stages.precision.direct import precision_direct

SPECS = [
    TensorSpec(name="image", shape=["batch", 3, 8, 8], dtype="uint8"),
    TensorSpec(name="ids", shape=["batch", 8], dtype="int64"),
    TensorSpec(name="mask", shape=["batch", 8], dtype="bool"),
]


def test_uint8_inputs_span_0_to_255_and_ids_keep_0_and_1() -> None:
    feed = random_inputs(SPECS, batch=4, int_ranges={})  # the graph's index ranges: none for the image
    image = feed["image"]
    assert image.dtype == np.uint8 and image.min() < 16 and image.max() > 240, (image.min(), image.max())
    assert set(np.unique(feed["ids"])) <= {0, 1} and feed["mask"].dtype == np.bool_
    ranged = random_inputs(SPECS, batch=4, int_ranges={"image": [3, 5]})  # a recorded range wins
    assert ranged["image"].min() >= 3 and ranged["image"].max() <= 5
    unknown = random_inputs(SPECS, batch=4)  # nothing says the uint8 input indexes no table (uint8 DNA ids)
    assert set(np.unique(unknown["image"])) <= {0, 1}


def uint8_classifier(path: Path) -> None:
    """A uint8 image, scaled to [0, 1], through a 3x3 convolution, ReLU and a linear layer over its pixels."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(np.float32(255.0), "scale"),
        numpy_helper.from_array((rng.standard_normal((8, 3, 3, 3)) / 4).astype(np.float32), "conv_w"),
        numpy_helper.from_array((rng.standard_normal(8) / 10).astype(np.float32), "conv_b"),
        numpy_helper.from_array((rng.standard_normal((512, 4)) / 20).astype(np.float32), "fc_w"),
        numpy_helper.from_array(np.zeros(4, np.float32), "fc_b"),
    ]
    nodes = [
        helper.make_node("Cast", ["image"], ["pixels"], to=TensorProto.FLOAT),
        helper.make_node("Div", ["pixels", "scale"], ["x"]),
        helper.make_node("Conv", ["x", "conv_w", "conv_b"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("Flatten", ["r"], ["f"]),
        helper.make_node("Gemm", ["f", "fc_w", "fc_b"], ["logits"]),
    ]
    g = helper.make_graph(
        nodes,
        "uint8_classifier",
        [helper.make_tensor_value_info("image", TensorProto.UINT8, ["batch", 3, 8, 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 4])],
        inits,
    )
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)


def test_a_uint8_image_models_variants_are_made_on_random_inputs(tmp_path: Path) -> None:
    """`kiln precision FILE --variants fp16,int8` without --calibration failed both variants of this model."""
    uint8_classifier(tmp_path / "m.onnx")
    settings = settings_for(stage_named("precision"), config_from_dict({}))
    summary = precision_direct(tmp_path / "m.onnx", tmp_path / "v", ["fp16", "int8"], None, settings)
    assert {"fp16", "int8"} <= set(summary["variants"]), summary
