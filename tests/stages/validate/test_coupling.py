"""Outputs whose rows may mix across a batch, read from the graph (BART's end-of-sequence pooling)."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from kiln.stages.validate.coupling import rows_may_mix


def _graph(nodes, inits=()):
    return helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", 6])],
        [
            helper.make_tensor_value_info("pooled", TensorProto.FLOAT, ["batch", 1]),
            helper.make_tensor_value_info("plain", TensorProto.FLOAT, ["batch", 6]),
        ],
        list(inits),
    )


def test_an_output_selected_by_a_mask_over_the_batch_may_mix_rows() -> None:
    """``hidden[ids == eos].view(batch, -1, h)``: the selected count decides which rows land in which batch row."""
    eos = numpy_helper.from_array(np.array(2, np.int64), "eos")
    shape = numpy_helper.from_array(np.array([-1, 1], np.int64), "shape")
    nodes = [
        helper.make_node("Cast", ["ids"], ["plain"], to=TensorProto.FLOAT),
        helper.make_node("Equal", ["ids", "eos"], ["mask"]),
        helper.make_node("NonZero", ["mask"], ["where"]),
        helper.make_node("Transpose", ["where"], ["idx"]),
        helper.make_node("GatherND", ["plain", "idx"], ["picked"]),
        helper.make_node("Reshape", ["picked", "shape"], ["pooled"]),
    ]
    assert rows_may_mix(_graph(nodes, [eos, shape])) == ["pooled"]


def test_a_selection_over_constants_alone_mixes_nothing() -> None:
    table = numpy_helper.from_array(np.array([[1.0], [0.0], [2.0]], np.float32), "table")
    nodes = [
        helper.make_node("Cast", ["ids"], ["plain"], to=TensorProto.FLOAT),
        helper.make_node("NonZero", ["table"], ["where"]),  # computed from the weights, the same for every request
        helper.make_node("Shape", ["where"], ["n"]),
        helper.make_node("Cast", ["n"], ["nf"], to=TensorProto.FLOAT),
        helper.make_node("ReduceSum", ["plain"], ["s"], keepdims=1),
        helper.make_node("Mul", ["s", "nf"], ["pooled"]),
    ]
    assert rows_may_mix(_graph(nodes, [table])) == []


def _fill(updates_nodes, updates: str, inits=()):
    """``plain[ids == 0] = <updates>``: NonZero's positions written by a ScatterND (how `hidden[~mask] = 0`
    exports: a Wav2Vec2's masked frames)."""
    zero = numpy_helper.from_array(np.array(0, np.int64), "zero")
    nodes = [
        helper.make_node("Cast", ["ids"], ["plain"], to=TensorProto.FLOAT),
        helper.make_node("Equal", ["ids", "zero"], ["mask"]),
        helper.make_node("NonZero", ["mask"], ["where"]),
        helper.make_node("Transpose", ["where"], ["idx"]),
        *updates_nodes,
        helper.make_node("ScatterND", ["plain", "idx", updates], ["filled"]),
        helper.make_node("Slice", ["filled", "s0", "s1", "s2"], ["pooled"]),
    ]
    starts = [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in (("s0", [0]), ("s1", [1]), ("s2", [1]))]
    return _graph(nodes, [zero, *starts, *inits])


def test_a_masked_fill_with_constants_keeps_every_row_its_own() -> None:
    """The fill's values: zeros sized by the selection (its count reaches them only as a shape)."""
    fill = numpy_helper.from_array(np.zeros(1, np.float32), "fill")
    nodes = [
        helper.make_node("Shape", ["where"], ["n_shape"]),
        helper.make_node("Slice", ["n_shape", "s2", "s3"], ["count"]),
        helper.make_node("Expand", ["fill", "count"], ["zeros"]),
    ]
    s3 = numpy_helper.from_array(np.array([2], np.int64), "s3")
    assert rows_may_mix(_fill(nodes, "zeros", [fill, s3])) == []


def test_a_masked_fill_beside_a_selection_that_mixes_is_told_apart_in_a_graph_of_unnamed_nodes() -> None:
    """The fill's NonZero and BART's eos gather, neither named (names are optional in ONNX): only the fill is
    exempt, and the gather's output still mixes rows."""
    fill = numpy_helper.from_array(np.zeros(1, np.float32), "fill")
    s3 = numpy_helper.from_array(np.array([2], np.int64), "s3")
    nodes = [
        helper.make_node("Shape", ["where"], ["n_shape"]),
        helper.make_node("Slice", ["n_shape", "s2", "s3"], ["count"]),
        helper.make_node("Expand", ["fill", "count"], ["zeros"]),
    ]
    graph = _fill(nodes, "zeros", [fill, s3])
    eos_nodes = [
        helper.make_node("NonZero", ["mask"], ["where2"]),
        helper.make_node("Transpose", ["where2"], ["idx2"]),
        helper.make_node("GatherND", ["plain", "idx2"], ["picked"]),
        helper.make_node("Reshape", ["picked", "shape"], ["plain_out"]),
    ]
    graph.node.extend(eos_nodes)
    graph.initializer.append(numpy_helper.from_array(np.array([-1, 6], np.int64), "shape"))
    graph.output[1].name = "plain_out"
    for node in graph.node:
        node.name = ""
    assert rows_may_mix(graph) == ["plain_out"]


def test_a_fill_with_values_from_the_batch_may_mix_rows() -> None:
    """Written with a sum over the whole batch: a row gets values of the others."""
    nodes = [helper.make_node("ReduceSum", ["plain"], ["total"], keepdims=0)]
    graph = _fill([*nodes, helper.make_node("Expand", ["total", "one"], ["written"])], "written")
    graph.initializer.append(numpy_helper.from_array(np.array([1], np.int64), "one"))
    assert rows_may_mix(graph) == ["pooled"]
