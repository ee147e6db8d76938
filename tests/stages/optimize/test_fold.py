"""fold_constants keeps onnx-graphsurgeon's shape-tensor cast elision away from nodes it would break, and the rest of
the folding (weights through a Transpose among it) still happens."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper as h

from tests.stages.optimize.optimize_helpers import FLOAT, INT64, f32, make_model, ops, run_pass, same_outputs


def _bucket_and_matmul(scale: str = "x", op: str = "Mul", to: int = INT64) -> onnx.ModelProto:
    """MPNet's relative-position bucket, ``Cast(op(scale, Cast(int64 const -> float)) -> to)`` read as a Gather
    index, beside a MatMul whose weight is stored transposed (``scale``: a float input, or a constant)."""
    nodes = [
        h.make_node("Cast", ["buckets"], ["buckets_f"], to=FLOAT),
        h.make_node(op, [scale, "buckets_f"], ["scaled"]),
        h.make_node("Cast", ["scaled"], ["idx"], to=to),
        h.make_node("Gather", ["table", "idx"], ["bias"], axis=0),
        h.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]),
        h.make_node("MatMul", ["h", "wt"], ["y"]),
    ]
    inits = {"buckets": np.array([1, 2, 3], np.int64), "table": f32(8, 4), "w": f32(6, 4), "half": np.float32(0.5)}
    inputs = [("x", ["N", 3], FLOAT), ("h", ["N", 4], FLOAT)]
    return make_model(nodes, inputs, ["bias", "y"], inits)


def test_a_float_variable_beside_a_cast_from_int_keeps_its_type_and_the_weights_fold():
    m = _bucket_and_matmul()
    out, _ = run_pass(m, "fold_constants")  # fails where the safety net rolled the pass back
    assert sorted(ops(out)) == ["Cast", "Gather", "MatMul", "Mul"]  # the Transpose and the constant Cast folded
    feed = {"x": np.array([[0.5, 1.0, 1.5], [2.0, 0.25, 1.0]], np.float32), "h": f32(2, 4)}
    same_outputs(m, out, feed)


def test_a_fractional_constant_is_not_cast_to_an_integer():
    """``Cast(0.5 * Cast(buckets -> float) -> int64)`` is [0, 1, 1]: elided it would read ``0 * buckets``."""
    m = _bucket_and_matmul(scale="half")
    out, _ = run_pass(m, "fold_constants")
    assert ops(out) == ["MatMul"]  # the bias folds whole: every input is a constant
    same_outputs(m, out, {"x": f32(2, 3), "h": f32(2, 4)})


def test_a_comparison_keeps_its_bool_output():
    nodes = [
        h.make_node("Cast", ["x"], ["xf"], to=FLOAT),
        h.make_node("Equal", ["xf", "two"], ["e"]),
        h.make_node("Cast", ["e"], ["y"], to=INT64),
    ]
    m = make_model(nodes, [("x", ["N"], INT64)], ["y"], {"two": np.float32(2.0)})
    out, _ = run_pass(m, "fold_constants")
    same_outputs(m, out, {"x": np.array([1, 2, 3], np.int64)})


def test_an_elision_of_int_casts_alone_still_happens():
    """Both inputs Casts from int64, read by a Cast back to int64: graphsurgeon's elision takes the casts out."""
    nodes = [
        h.make_node("Cast", ["x"], ["xf"], to=FLOAT),
        h.make_node("Cast", ["n"], ["nf"], to=FLOAT),
        h.make_node("Add", ["xf", "nf"], ["s"]),
        h.make_node("Cast", ["s"], ["y"], to=INT64),
    ]
    m = make_model(nodes, [("x", ["N"], INT64), ("n", ["N"], INT64)], ["y"], {})
    out, _ = run_pass(m, "fold_constants")
    assert ops(out) == ["Add"]
