"""kiln.core.onnx_io.index_ranges through a constant added to an index: a tabular FT-Transformer's categorical
columns share one embedding, each column shifted to its own rows by an offset (``emb(x_cat + offsets)``)."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper
from torch import nn

from kiln.core.onnx_io import index_ranges, outside_index
from kiln.core.records import EngineMetadata, TensorSpec
from kiln.stages.engines.stage import _index_ranges

INT64, INT32, FLOAT = onnx.TensorProto.INT64, onnx.TensorProto.INT32, onnx.TensorProto.FLOAT
CARDINALITIES = [4, 10, 3]  # offsets 0, 4, 14 into one table of 17 rows


class _FtTokenizer(nn.Module):
    """The FT-Transformer reference code's feature tokenizer: every categorical column indexes one shared
    ``nn.Embedding(sum(cardinalities), d)`` after a per-column offset buffer is added."""

    def __init__(self) -> None:
        super().__init__()
        offsets = torch.tensor([0, *CARDINALITIES[:-1]]).cumsum(0)
        self.register_buffer("offsets", offsets)
        self.emb, self.num = nn.Embedding(sum(CARDINALITIES), 4), nn.Linear(7, 4)
        self.head = nn.Linear(16, 1)

    def forward(self, x_num: torch.Tensor, x_cat: torch.Tensor) -> torch.Tensor:
        tokens = torch.cat([self.num(x_num)[:, None], self.emb(x_cat + self.offsets[None])], 1)
        return self.head(tokens.flatten(1))


def _ft_graph(tmp_path: Path) -> onnx.ModelProto:
    path = tmp_path / "ft.onnx"
    x_cat = torch.stack([torch.randint(0, k, (4,)) for k in CARDINALITIES], 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the TorchScript exporter: fast; dynamo writes the same
        torch.onnx.export(
            _FtTokenizer().eval(),
            (torch.rand(4, 7), x_cat),
            str(path),
            input_names=["x_num", "x_cat"],
            output_names=["y"],
            dynamic_axes={"x_num": {0: "batch"}, "x_cat": {0: "batch"}, "y": {0: "batch"}},
            dynamo=False,
        )
    return onnx.load(str(path))


def test_columns_shifted_into_one_shared_table_take_the_rows_the_table_leaves_each(tmp_path: Path) -> None:
    """Column j indexes row x + offset[j] of 17: it takes -offset[j] to 16 - offset[j]; a value past that is named
    with its column before ONNX Runtime's Gather stops at it with a traceback."""
    graph = _ft_graph(tmp_path)
    assert index_ranges(graph) == {"x_cat": [[0, 16], [-4, 12], [-14, 2]]}
    assert outside_index(graph, {"x_cat": np.array([[3, 9, 2]])}, "ft.onnx") is None
    assert outside_index(graph, {"x_cat": np.array([[0, 0, 3]])}, "ft.onnx") == (
        "input 'x_cat' holds 3 in column 2 (x_cat[..., 2]): ft.onnx indexes an axis of 17 positions with it "
        "(values -14 to 2, or down to -31 counted from its end)"
    )


def test_the_engine_refuses_a_shifted_column_past_the_shared_table_naming_the_column(tmp_path: Path) -> None:
    """The engine's record holds a range per column: 3 in column 2 (row 17 of 17) and -1 in column 0 are refused
    by name; without a range a server answers them (a wrong row, or HTTP 500 from ONNX Runtime's Gather)."""
    taken = [TensorSpec(name="x_cat", shape=["batch", 3], dtype="int64")]
    ranges = _index_ranges(_ft_graph(tmp_path), taken, {"x_cat": [[0, 3], [0, 9], [0, 2]]})
    meta = EngineMetadata.model_construct(name="ft", index_ranges=ranges)
    assert meta.outside_values({"x_cat": np.array([[3, 9, 2], [0, 0, 0]])}) is None
    assert meta.outside_values({"x_cat": np.array([[0, 0, 3]])}).startswith(
        "input 'x_cat' holds 3 in column 2 (x_cat[..., 2]): engine ft takes values from "
    )
    assert meta.outside_values({"x_cat": np.array([[-1, 0, 0]])}).startswith(
        "input 'x_cat' holds -1 in column 0 (x_cat[..., 0]): engine ft takes values from 0 to 16 there "
    )


def _shifted_graph(operands: list[str], op: str = "Add") -> onnx.ModelProto:
    """ids (int32) -> Cast to int64 (ids64) -> ``op`` of ``operands`` (ids64, the constant 3 or the input other) ->
    Gather over a 10-row table."""
    nodes = [
        helper.make_node("Constant", [], ["three"], value=numpy_helper.from_array(np.array(3, np.int64), "three")),
        helper.make_node("Cast", ["ids"], ["ids64"], to=INT64),
        helper.make_node(op, operands, ["rows"]),
        helper.make_node("Gather", ["table", "rows"], ["y"]),
    ]
    inputs = [
        helper.make_tensor_value_info("ids", INT32, ["batch", 2]),
        helper.make_tensor_value_info("other", INT64, ["batch", 2]),
    ]
    table = numpy_helper.from_array(np.zeros((10, 4), np.float32), "table")
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", FLOAT, None)], [table])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_a_cast_then_a_scalar_constant_shifts_the_range() -> None:
    """``table[ids + 3]`` takes -3 to 6, ``table[ids - 3]`` 3 to 12, through a Cast to int64; an Add's operands
    come in either order."""
    assert index_ranges(_shifted_graph(["ids64", "three"])) == {"ids": [-3, 6]}
    assert index_ranges(_shifted_graph(["three", "ids64"])) == {"ids": [-3, 6]}
    assert index_ranges(_shifted_graph(["ids64", "three"], "Sub")) == {"ids": [3, 12]}
    # ``3 - ids`` reverses the values, and ``ids + other`` adds values the graph does not know: no range
    assert index_ranges(_shifted_graph(["three", "ids64"], "Sub")) == {}
    assert index_ranges(_shifted_graph(["ids64", "other"])) == {}
