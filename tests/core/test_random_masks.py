"""Random boolean inputs are masks more often than not (a key-padding mask, True = padding; an attention mask,
True = attend): a row of one value alone masks every position, and attention over it is NaN. Each row of a random
mask holds both values, under either convention."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from kiln.core.inputs import random_inputs
from kiln.core.records import TensorSpec
from tests.pipeline.test_faults import invoke


def _mixed(mask: np.ndarray) -> bool:
    return bool((mask.any(axis=-1) & ~mask.all(axis=-1)).all())


def test_each_row_of_a_random_mask_holds_both_values() -> None:
    specs = [
        TensorSpec(name="pad", shape=["batch", 2], dtype="bool"),
        TensorSpec(name="grid", shape=["batch", 3, "seq"], dtype="bool"),
    ]
    feed = random_inputs(specs, batch=64, dynamic=3)
    assert all(_mixed(mask) for mask in feed.values()), feed
    again = random_inputs(specs, batch=64, dynamic=3)
    assert all(np.array_equal(feed[k], again[k]) for k in feed)  # seeded
    flags = random_inputs([TensorSpec(name="flag", shape=["batch"], dtype="bool")], batch=1)
    assert flags["flag"].shape == (1,)  # a [batch] flag or a one-wide axis: left as drawn


def test_a_random_mask_cut_to_a_smaller_size_still_holds_both_values() -> None:
    """Drawn at an axis' largest size and cut to its smaller ones, as the checks at each validated size cut it
    (keeping the first positions, or the last where rows look left-padded)."""
    (mask,) = random_inputs([TensorSpec(name="pad", shape=["batch", "seq"], dtype="bool")], 512, dynamic=64).values()
    for size in (2, 3, 8):
        assert _mixed(mask[:, :size]) and _mixed(mask[:, -size:]), size


def test_a_masked_softmax_over_random_inputs_is_finite() -> None:
    """ONNX Runtime's softmax over a key-padding-masked row, as nn.MultiheadAttention exports it."""
    graph = helper.make_graph(
        [
            helper.make_node("Constant", [], ["ninf"], value=helper.make_tensor("v", TensorProto.FLOAT, [], [-np.inf])),
            helper.make_node("Where", ["pad", "ninf", "x"], ["scores"]),
            helper.make_node("Softmax", ["scores"], ["attn"], axis=-1),
        ],
        "masked_softmax",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq"]),
            helper.make_tensor_value_info("pad", TensorProto.BOOL, ["batch", "seq"]),
        ],
        [helper.make_tensor_value_info("attn", TensorProto.FLOAT, ["batch", "seq"])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    specs = [
        TensorSpec(name="x", shape=["batch", "seq"], dtype="float32"),
        TensorSpec(name="pad", shape=["batch", "seq"], dtype="bool"),
    ]
    (attn,) = session.run(None, random_inputs(specs, batch=256, dynamic=4))
    assert np.isfinite(attn).all()


def _masked_pooling(path: Path) -> Path:
    """x [batch, seq, 4] -> a linear layer -> attention pooling over seq with a key-padding mask (True = padding,
    its scores set to -inf) -> logits [batch, 4]: a fully padded row pools NaN."""
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((4, 4)).astype(np.float32), "w")
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="proj"),
        helper.make_node("ReduceSum", ["h", "last"], ["scores"], keepdims=0, name="score"),
        helper.make_node("Where", ["pad", "ninf", "scores"], ["masked"], name="mask"),
        helper.make_node("Softmax", ["masked"], ["attn"], axis=-1, name="softmax"),
        helper.make_node("Unsqueeze", ["attn", "one"], ["attn3"], name="unsqueeze"),
        helper.make_node("MatMul", ["attn3", "h"], ["pooled"], name="pool"),
        helper.make_node("Squeeze", ["pooled", "one"], ["logits"], name="squeeze"),
    ]
    consts = [
        numpy_helper.from_array(np.array([-1], np.int64), "last"),
        numpy_helper.from_array(np.array([1], np.int64), "one"),
        numpy_helper.from_array(np.array(-np.inf, np.float32), "ninf"),
    ]
    graph = helper.make_graph(
        nodes,
        "masked_pooling",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 4]),
            helper.make_tensor_value_info("pad", TensorProto.BOOL, ["batch", "seq"]),
        ],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 4])],
        [w, *consts],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_precision_on_random_inputs_of_a_padding_mask_model_is_checked_at_each_size(tmp_path: Path) -> None:
    """`kiln precision FILE` without --calibration draws the mask at seq=64 and checks the variant at seq=2 too."""
    model = _masked_pooling(tmp_path / "m.onnx")
    out = invoke(
        "precision", model, "-o", tmp_path / "v", "--variants", "int8", "--set", "signature.shapes={seq: [2, 64]}"
    )
    assert out.exit_code == 0, out.output
    assert "undefined" not in out.output
