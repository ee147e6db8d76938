"""kiln.core.onnx_io.index_ranges beyond embeddings: integer inputs whose values reach the indices of
GatherElements, ScatterElements, GatherND, ScatterND, or of a Gather over a computed tensor (a graph neural
network's ``edge_index``), whole or row by row (Gather of a constant row, Slice, Split)."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import helper, numpy_helper
from torch import nn

from kiln.core.onnx_io import index_ranges, outside_index

INT64, FLOAT = onnx.TensorProto.INT64, onnx.TensorProto.FLOAT


def _const(name: str, value: object, dtype: type = np.int64) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.array(value, dtype), name))


def _model(
    nodes: list, inputs: list, outputs: list[str], inits: list | None = None, opset: int = 18
) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "g", inputs, [helper.make_tensor_value_info(o, FLOAT, None) for o in outputs], inits or []
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _gin_graph(nodes_axis: int | str = 12, edges: int | str = 6) -> onnx.ModelProto:
    """One GIN layer as torch.onnx.export(dynamo=True) writes it: h = x @ w [batch, nodes, 4]; src, dst: Gather of
    row 0 and row 1 (scalar constants, axis 1) of edge_index [batch, 2, edges] -> Slice of all edges (bounds as
    Reshape(Cast(Constant)), as dynamo writes ``[:, 0, :]``) -> Unsqueeze -> Expand to [1, 1, 4] -> Cast int64 ->
    GatherElements(h, axis 1) and ScatterElements(zeros shaped like h, axis 1, add): the zeros' shape is known only
    by propagating Shape(h) into Expand."""
    w = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    bounds = []
    for name, value in (("start", 0), ("end", np.iinfo(np.int64).max), ("axis", 1)):
        bounds += [
            _const(f"{name}0", value),
            helper.make_node("Cast", [f"{name}0"], [f"{name}1"], to=INT64),
            helper.make_node("Reshape", [f"{name}1", "last"], [name]),
        ]
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        _const("row0", 0),
        _const("row1", 1),
        _const("last", [-1]),
        _const("wide", [1, 1, 4]),
        *bounds,
        helper.make_node("Gather", ["edge_index", "row0"], ["src0"], axis=1),
        helper.make_node("Slice", ["src0", "start", "end", "axis"], ["src"]),
        helper.make_node("Gather", ["edge_index", "row1"], ["dst0"], axis=1),
        helper.make_node("Slice", ["dst0", "start", "end", "axis"], ["dst"]),
        helper.make_node("Unsqueeze", ["src", "last"], ["src1"]),
        helper.make_node("Expand", ["src1", "wide"], ["src2"]),
        helper.make_node("Cast", ["src2"], ["src3"], to=INT64),
        helper.make_node("GatherElements", ["h", "src3"], ["msg"], axis=1),
        helper.make_node("Unsqueeze", ["dst", "last"], ["dst1"]),
        helper.make_node("Expand", ["dst1", "wide"], ["dst2"]),
        _const("zero", 0.0, np.float32),
        helper.make_node("Shape", ["h"], ["hshape"]),
        helper.make_node("Expand", ["zero", "hshape"], ["zeros"]),
        helper.make_node("ScatterElements", ["zeros", "dst2", "msg"], ["agg"], axis=1, reduction="add"),
    ]
    inputs = [
        helper.make_tensor_value_info("x", FLOAT, ["batch", nodes_axis, 4]),
        helper.make_tensor_value_info("edge_index", INT64, ["batch", 2, edges]),
    ]
    return _model(nodes, inputs, ["agg"], [w])


def test_edge_indices_through_gather_elements_and_scatter_elements_take_the_node_count() -> None:
    assert index_ranges(_gin_graph()) == {"edge_index": [0, 11]}
    assert index_ranges(_gin_graph(edges="edges")) == {"edge_index": [0, 11]}  # a dynamic edge axis: same nodes


def test_a_dynamic_node_axis_gives_no_range() -> None:
    assert index_ranges(_gin_graph(nodes_axis="nodes")) == {}


def test_an_edge_index_past_the_nodes_is_named_before_onnx_runtime_sees_it() -> None:
    """ONNX Runtime's own answer is a GatherElements traceback; ONNX's ops count -12 from the end (torch.gather
    refuses it; the engine's record starts where its data does: tests/stages/engines/test_stage.py)."""
    graph = _gin_graph()
    x, edges = np.ones((1, 12, 4), np.float32), np.zeros((1, 2, 6), np.int64)
    edges[0, 0, 0] = 12
    with pytest.raises(Exception, match="GatherElements"):
        ort.InferenceSession(graph.SerializeToString()).run(None, {"x": x, "edge_index": edges})
    assert outside_index(graph, {"x": x, "edge_index": edges}, "gin.onnx") == (
        "input 'edge_index' holds 12: gin.onnx indexes an axis of 12 positions with it (values 0 to 11, or down to -12 "
        "counted from its end)"
    )
    assert outside_index(graph, {"edge_index": edges - 12}, "gin.onnx") is None


def _rows_graph(split: str, second: str = "GatherElements", cols: int = 2) -> onnx.ModelProto:
    """edge_index [batch, cols, 6] split into its rows by ``split`` (Gather of a constant row, Slice, Split); row 0
    goes to a GatherElements over x [batch, 12, 4], row 1 to ``second``: GatherElements again, or Add (values
    changed: that row indexes nothing)."""
    nodes = [_const("r0", [0]), _const("r1", [1]), _const("r2", [2]), _const("ax", [1])]
    if split == "Gather":
        nodes += [
            helper.make_node("Gather", ["edge_index", "r0"], ["a"], axis=1),
            helper.make_node("Gather", ["edge_index", "r1"], ["b"], axis=1),
        ]
    elif split == "Slice":
        nodes += [
            helper.make_node("Slice", ["edge_index", "r0", "r1", "ax"], ["a"]),
            helper.make_node("Slice", ["edge_index", "r1", "r2", "ax"], ["b"]),
        ]
    else:
        nodes += [helper.make_node("Split", ["edge_index"], ["a", "b"], axis=1, num_outputs=2)]
    nodes += [helper.make_node("Reshape", ["a", "flat"], ["a1"]), helper.make_node("Reshape", ["b", "flat"], ["b1"])]
    nodes += [helper.make_node("GatherElements", ["x", "a1"], ["ya"], axis=1)]
    if second == "Add":
        nodes += [helper.make_node("Add", ["b1", "b1"], ["b2"]), helper.make_node("Cast", ["b2"], ["yb"], to=FLOAT)]
    else:
        nodes += [helper.make_node("GatherElements", ["x", "b1"], ["yb"], axis=1)]
    inputs = [
        helper.make_tensor_value_info("x", FLOAT, ["batch", 12, 4]),
        helper.make_tensor_value_info("edge_index", INT64, ["batch", cols, 6]),
    ]
    flat = numpy_helper.from_array(np.array([-1, 6, 1], np.int64), "flat")
    return _model(nodes, inputs, ["ya", "yb"], [flat])


@pytest.mark.parametrize("split", ["Gather", "Slice", "Split"])
def test_rows_taken_apart_each_reaching_the_nodes_take_the_node_count(split: str) -> None:
    assert index_ranges(_rows_graph(split)) == {"edge_index": [0, 11]}


@pytest.mark.parametrize("split", ["Gather", "Slice", "Split"])
def test_a_row_that_indexes_nothing_leaves_the_input_without_range(split: str) -> None:
    """Row 1's values are summed, not used as indices: any value is right there, and a range would refuse it."""
    assert index_ranges(_rows_graph(split, second="Add")) == {}


def test_rows_that_are_not_all_taken_leave_the_input_without_range() -> None:
    """A third row no node reads (the rows 0 and 1 are Gathered) may hold anything."""
    assert index_ranges(_rows_graph("Gather", cols=3)) == {}


def test_columns_indexing_tables_of_their_own_take_a_range_each() -> None:
    """A tabular model's categorical columns, each with its own embedding (10 and 5 rows): each column takes its
    own table's rows (the larger table's range let a 7 in column 1 through to ONNX Runtime); an input whose whole
    values also reach a 4-row table takes 4 in every column, one range."""
    tables = [numpy_helper.from_array(np.zeros((n, 3), np.float32), f"t{n}") for n in (10, 5, 4)]
    nodes = [
        _const("c0", 0),
        _const("c1", 1),
        helper.make_node("Gather", ["cats", "c0"], ["col0"], axis=1),
        helper.make_node("Gather", ["cats", "c1"], ["col1"], axis=1),
        helper.make_node("Gather", ["t10", "col0"], ["e0"]),
        helper.make_node("Gather", ["t5", "col1"], ["e1"]),
        helper.make_node("Gather", ["both", "c0"], ["both0"], axis=1),
        helper.make_node("Gather", ["both", "c1"], ["both1"], axis=1),
        helper.make_node("Gather", ["t10", "both0"], ["f0"]),
        helper.make_node("Gather", ["t5", "both1"], ["f1"]),
        helper.make_node("Gather", ["t4", "both"], ["f2"]),
    ]
    inputs = [helper.make_tensor_value_info(n, INT64, ["batch", 2]) for n in ("cats", "both")]
    graph = _model(nodes, inputs, ["e0", "e1", "f0", "f1", "f2"], tables)
    assert index_ranges(graph) == {"cats": [[0, 9], [0, 4]], "both": [0, 3]}


def _packed_graph(rows: tuple[int, ...] = (10, 1000)) -> onnx.ModelProto:
    """A recommender's categorical ids packed in one ``sparse [batch, len(rows)]`` input, as
    torch.onnx.export(dynamo=True) writes ``table_i(sparse[:, i])``: Gather of a scalar constant column on axis 1,
    then Gather over table i (of ``rows[i]`` rows)."""
    tables = [numpy_helper.from_array(np.ones((n, 2), np.float32), f"t{i}") for i, n in enumerate(rows)]
    nodes = []
    for i in range(len(rows)):
        nodes += [
            _const(f"c{i}", i),
            helper.make_node("Gather", ["sparse", f"c{i}"], [f"col{i}"], axis=1),
            helper.make_node("Gather", [f"t{i}", f"col{i}"], [f"e{i}"]),
        ]
    nodes += [helper.make_node("Concat", [f"e{i}" for i in range(len(rows))], ["y"], axis=1)]
    inputs = [helper.make_tensor_value_info("sparse", INT64, ["batch", len(rows)])]
    return _model(nodes, inputs, ["y"], tables)


def test_packed_columns_into_tables_of_other_sizes_take_a_range_per_column() -> None:
    """``sparse[:, 0]`` into a 10-row table, ``sparse[:, 1]`` into 1000 rows: one range per column, so that an id
    of 50 in column 0 is named before ONNX Runtime's Gather traceback (the input's one range was [0, 999], which let
    it through); columns into tables of one size keep one range."""
    graph = _packed_graph()
    assert index_ranges(graph) == {"sparse": [[0, 9], [0, 999]]}
    assert index_ranges(_packed_graph((7, 7))) == {"sparse": [0, 6]}
    sparse = np.array([[3, 900], [50, 1]], np.int64)
    with pytest.raises(Exception, match="idx=50 must be within the inclusive range"):
        ort.InferenceSession(graph.SerializeToString()).run(None, {"sparse": sparse})
    assert outside_index(graph, {"sparse": sparse}, "rec.onnx") == (
        "input 'sparse' holds 50 in column 0 (sparse[..., 0]): rec.onnx indexes an axis of 10 positions with it "
        "(values 0 to 9, or down to -10 counted from its end)"
    )
    assert outside_index(graph, {"sparse": np.array([[-10, 999], [9, -1000]])}, "rec.onnx") is None


def test_gather_over_a_computed_tensor_takes_its_axis_when_static() -> None:
    """``h.index_select(1, idx)`` over a computed [batch, 12, 4]; the same over axis 0, the batch, has no range."""
    nodes = [
        helper.make_node("Relu", ["x"], ["h"]),
        helper.make_node("Gather", ["h", "idx"], ["y"], axis=1),
        helper.make_node("Gather", ["h", "rows"], ["z"], axis=0),
    ]
    inputs = [
        helper.make_tensor_value_info("x", FLOAT, ["batch", 12, 4]),
        helper.make_tensor_value_info("idx", INT64, [5]),
        helper.make_tensor_value_info("rows", INT64, [5]),
    ]
    assert index_ranges(_model(nodes, inputs, ["y", "z"])) == {"idx": [0, 11]}


def test_gather_nd_and_scatter_nd_take_the_largest_dim_their_index_addresses() -> None:
    """An index's last axis addresses several dims (here 10 and 3): each column has its own bound, so the one range
    of the whole input is the largest, 0 to 9; the smallest would refuse a valid 5 in column 0. With batch_dims 1
    the addressed dims start after the batch's; an addressed dim that is dynamic gives no range."""
    nodes = [
        helper.make_node("GatherND", ["grid", "pairs"], ["y"]),
        helper.make_node("GatherND", ["cube", "per_row"], ["z"], batch_dims=1),
        helper.make_node("GatherND", ["open", "loose"], ["w"]),
        helper.make_node("ScatterND", ["table", "where", "updates"], ["s"]),
    ]
    inputs = [
        helper.make_tensor_value_info("grid", FLOAT, [10, 3]),
        helper.make_tensor_value_info("pairs", INT64, ["n", 2]),
        helper.make_tensor_value_info("cube", FLOAT, ["batch", 5, 7, 4]),
        helper.make_tensor_value_info("per_row", INT64, ["batch", "n", 2]),
        helper.make_tensor_value_info("open", FLOAT, ["rows", 3]),
        helper.make_tensor_value_info("loose", INT64, ["n", 2]),
        helper.make_tensor_value_info("table", FLOAT, [6, 4]),
        helper.make_tensor_value_info("where", INT64, ["n", 1]),
        helper.make_tensor_value_info("updates", FLOAT, ["n", 4]),
    ]
    graph = _model(nodes, inputs, ["y", "z", "w", "s"])
    assert index_ranges(graph) == {"pairs": [0, 9], "per_row": [0, 6], "where": [0, 5]}


def test_embedding_ranges_are_unchanged() -> None:
    """The embedding cases index_ranges had before (tests/core/test_onnx_io.py's graph): a 1-D table gives none."""
    from tests.core.test_onnx_io import _indexing_graph

    assert index_ranges(_indexing_graph()) == {"ids": [0, 9], "kind": [0, 1], "pos": [-1, 8], "small": [0, 9]}


class _Gin(nn.Module):
    """A GIN layer: messages by torch.gather, summed into nodes by scatter_add_ (GatherElements, ScatterElements)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        src, dst = edge_index[:, 0, :], edge_index[:, 1, :]
        msg = torch.gather(h, 1, src.unsqueeze(-1).expand(-1, -1, h.shape[-1]))
        return torch.zeros_like(h).scatter_add_(1, dst.unsqueeze(-1).expand(-1, -1, h.shape[-1]), msg)


def test_a_torch_gnn_export_records_its_node_count(tmp_path) -> None:
    path = tmp_path / "gin.onnx"
    edges = torch.randint(0, 7, (2, 2, 5))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the TorchScript exporter: 0.2 s, where dynamo takes 3
        torch.onnx.export(
            _Gin().eval(),
            (torch.rand(2, 7, 4), edges),
            str(path),
            input_names=["x", "edge_index"],
            output_names=["y"],
            dynamic_axes={"x": {0: "batch"}, "edge_index": {0: "batch"}, "y": {0: "batch"}},
            dynamo=False,
        )
    assert index_ranges(onnx.load(str(path))) == {"edge_index": [0, 6]}


def _unwrapped_graph(self_loops: object = None, dynamic_loop: bool = False) -> onnx.ModelProto:
    """A GCN layer behind a batch axis of one, as torch.onnx.export(dynamo=True) writes ``x[0]``, ``edge_index[0]``:
    x [batch, 12, 4], edge_index [batch, 2, edges] -> Gather of the scalar 0 along the batch axis -> src, dst (Gather
    of row 0 and row 1). ``self_loops``: the upper bound of ``Range(0, n, 1)`` (``torch.arange``) concatenated to src
    and dst (``torch.cat``: add_self_loops), or with ``dynamic_loop`` another graph input; then dst indexes a
    ScatterND (``index_add_``) and src a GatherND, else dst a ScatterElements (``scatter_add_``) and src a Gather."""
    nodes = [
        _const("zero", 0),
        _const("one", 1),
        _const("last", [-1]),
        _const("wide", [1, 4]),
        helper.make_node("Gather", ["x", "zero"], ["h"], axis=0),
        helper.make_node("Gather", ["edge_index", "zero"], ["e"], axis=0),
        helper.make_node("Gather", ["e", "zero"], ["src"], axis=0),
        helper.make_node("Gather", ["e", "one"], ["dst"], axis=0),
    ]
    inputs = [
        helper.make_tensor_value_info("x", FLOAT, ["batch", 12, 4]),
        helper.make_tensor_value_info("edge_index", INT64, ["batch", 2, "edges"]),
    ]
    if self_loops is None and not dynamic_loop:
        nodes += [
            helper.make_node("Gather", ["h", "src"], ["msg"], axis=0),
            helper.make_node("Unsqueeze", ["dst", "last"], ["dst1"]),
            helper.make_node("Expand", ["dst1", "wide"], ["dst2"]),
            helper.make_node("ScatterElements", ["h", "dst2", "msg"], ["agg"], axis=0, reduction="add"),
        ]
        return _model(nodes, inputs, ["agg"])
    if dynamic_loop:
        inputs.append(helper.make_tensor_value_info("loop", INT64, ["n"]))
    else:
        nodes += [_const("n", self_loops), helper.make_node("Range", ["zero", "n", "one"], ["loop"])]
    nodes += [
        helper.make_node("Concat", ["src", "loop"], ["src_all"], axis=0),
        helper.make_node("Concat", ["dst", "loop"], ["dst_all"], axis=0),
        helper.make_node("Unsqueeze", ["src_all", "last"], ["src1"]),
        helper.make_node("Unsqueeze", ["dst_all", "last"], ["dst1"]),
        helper.make_node("GatherND", ["h", "src1"], ["msg"]),
        helper.make_node("ScatterND", ["h", "dst1", "msg"], ["agg"], reduction="add"),
    ]
    return _model(nodes, inputs, ["agg"])


def test_a_batch_of_one_unwrapped_by_a_gather_keeps_the_node_count() -> None:
    """``edge_index[0]`` is a Gather of constant positions along the batch axis, whose size is no number: its
    values pass through unchanged, and its rows then index the 12 nodes."""
    graph = _unwrapped_graph()
    assert index_ranges(graph) == {"edge_index": [0, 11]}
    x, edges = np.ones((1, 12, 4), np.float32), np.zeros((1, 2, 5), np.int64)
    edges[0, 1, 2] = -1  # ONNX Runtime counts it from the end; torch refuses it: the range names it
    ort.InferenceSession(graph.SerializeToString()).run(None, {"x": x, "edge_index": edges})
    assert outside_index(graph, {"edge_index": edges}, "gcn.onnx") is None  # -1 counts from the end in ONNX
    edges[0, 1, 2] = 12
    assert "holds 12" in (outside_index(graph, {"edge_index": edges}, "gcn.onnx") or "")


def test_self_loops_concatenated_within_the_nodes_keep_the_node_count() -> None:
    """``torch.cat([src, torch.arange(n)])``: a Concat whose other input is a range of constants within the table
    keeps the edge ids' meaning (index_add_ through ScatterND, x[src] through GatherND)."""
    assert index_ranges(_unwrapped_graph(self_loops=12)) == {"edge_index": [0, 11]}


def test_a_concat_of_values_past_the_table_or_unknown_keeps_no_range() -> None:
    """Self loops past the 12 nodes, or another input's values, are not what the ids index alone: no range."""
    assert index_ranges(_unwrapped_graph(self_loops=13)) == {}
    assert index_ranges(_unwrapped_graph(dynamic_loop=True)) == {}
