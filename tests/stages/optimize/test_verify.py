"""The safety net's random inputs: an integer mask the data gave no range for is drawn as 0/1 with a position kept
in every row, since a mask of other values (up to optimize.int_high) may make a graph divide by zero natively."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper as h

from kiln.stages.optimize.config import OptimizeConfig
from kiln.stages.optimize.verify import random_inputs


def _model() -> onnx.ModelProto:
    """ids, attention_mask, global_attention_mask: int64 [batch, seq], summed into one output."""
    names = ["input_ids", "attention_mask", "global_attention_mask"]
    inputs = [h.make_tensor_value_info(n, onnx.TensorProto.INT64, ["batch", "seq"]) for n in names]
    out = h.make_tensor_value_info("y", onnx.TensorProto.INT64, ["batch", "seq"])
    nodes = [h.make_node("Add", names[:2], ["s"]), h.make_node("Add", ["s", names[2]], ["y"])]
    return h.make_model(h.make_graph(nodes, "g", inputs, [out]), opset_imports=[h.make_opsetid("", 18)])


def test_integer_masks_without_data_are_drawn_as_bits_with_a_kept_position_per_row() -> None:
    feed = random_inputs(_model(), OptimizeConfig(int_high=15, verify_batch=4), dynamic=16)
    for name in ("attention_mask", "global_attention_mask"):
        mask = feed[name]
        assert mask.shape == (4, 16) and mask.dtype == np.int64
        assert set(np.unique(mask)) <= {0, 1} and (mask.max(axis=-1) == 1).all(), name
    assert feed["input_ids"].max() > 1  # the ids keep int_high's range


def test_a_mask_with_a_range_from_the_data_keeps_it() -> None:
    feed = random_inputs(_model(), OptimizeConfig(int_high=15), dynamic=16, int_ranges={"attention_mask": [3, 5]})
    assert feed["attention_mask"].min() >= 3 and feed["attention_mask"].max() <= 5
