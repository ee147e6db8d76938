"""The fix for a graph the optimizer's safety net cannot run (:func:`kiln.stages.optimize.api.unrunnable_hint`):
inputs without a common batch axis name the batch-of-one layout, and optimize.int_high is named only where an
integer input indexes a table; a size refused at a convolution names signature.shapes first."""

from __future__ import annotations

import numpy as np
from onnx import helper as h

from kiln.stages.optimize.api import unrunnable_hint
from tests.stages.optimize.optimize_helpers import FLOAT, INT64, f32, make_model

N = h.make_node


def test_a_graph_without_a_batch_axis_is_told_the_batch_of_one_layout_not_int_high() -> None:
    """A GNN's ``x [nodes, 16]`` beside ``edge_index [2, edges]``: the net sizes axis 0 of both as the batch, so a
    lower int_high only checks a graph of a node or two."""
    m = make_model(
        [
            N("Gather", ["edge_index", "zero"], ["src"], axis=0),
            N("Gather", ["x", "src"], ["msg"], axis=0),
            N("ReduceSum", ["msg"], ["y"], keepdims=0),
        ],
        [("x", ["nodes", 16], FLOAT), ("edge_index", [2, "edges"], INT64)],
        ["y"],
        {"zero": np.array(0, np.int64)},
    )
    why = "indices element out of data bounds, idx=9 must be within the inclusive range [-2,1]"
    hint = unrunnable_hint(m, why, None, by_shapes=True)
    assert hint.startswith("the graph: input 'edge_index' [2, edges] has a fixed axis 0 (2)"), hint
    assert "x [1, nodes, 16], edge_index [1, 2, edges]" in hint and "signature.batch_sizes: [1]" in hint, hint
    assert "int_high" not in hint


def _audio(ids: bool) -> object:
    """A convolution (kernel 20) over float audio ``x [N, 1, samples]`` beside an integer mask the graph only sums
    (and, with ``ids``, token ids that index an embedding, doubled: drawn from [0, int_high])."""
    nodes = [
        N("Conv", ["x", "w"], ["y"]),
        N("ReduceSum", ["mask"], ["count"], keepdims=0),
        N("Cast", ["count"], ["n"], to=FLOAT),
    ]
    inputs = [("x", ["N", 1, "samples"], FLOAT), ("mask", ["N", "samples"], INT64)]
    inits = {"w": f32(4, 1, 20)}
    if ids:
        nodes += [N("Mul", ["ids", "two"], ["doubled"]), N("Gather", ["table", "doubled"], ["g"])]
        inputs.append(("ids", ["N", 3], INT64))
        inits |= {"table": f32(5, 4), "two": np.array(2, np.int64)}
    return make_model(nodes, inputs, ["y", "n", *(["g"] if ids else [])], inits)


CONV = "Non-zero status code returned while running Conv node. Name:'conv' Status Message: Invalid input shape: {2}"


def test_an_integer_mask_is_not_told_int_high_and_signature_shapes_comes_first() -> None:
    hint = unrunnable_hint(_audio(ids=False), CONV, {}, by_shapes=True)
    assert "int_high" not in hint, hint
    assert hint.startswith("give the sizes the model takes on axis 'samples': --set 'signature.shapes="), hint


def test_a_size_refused_at_a_convolution_names_signature_shapes_before_int_high() -> None:
    hint = unrunnable_hint(_audio(ids=True), CONV, {}, by_shapes=True)
    assert hint.startswith("give the sizes the model takes on axis 'samples'"), hint
    assert "; or set optimize.int_high below the smallest vocabulary / index range" in hint, hint
