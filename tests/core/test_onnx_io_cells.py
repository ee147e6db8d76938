"""kiln.core.onnx_io.index_ranges where the tables lie on an axis before the last: a DLRM-style recommender's
multi-hot ids ``sparse [batch, 4, 3]``, 4 tables of 3 ids each, ``table_i(sparse[:, i])``: one range per cell of the
fixed axes after the batch, flattened (cell ``t * 3 + j`` is table ``t``'s)."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import helper, numpy_helper
from torch import nn

from kiln.core.onnx_io import index_ranges, outside_index
from kiln.core.records import EngineMetadata, TensorSpec
from kiln.stages.engines.stage import _index_ranges

CARDINALITIES = [1000, 50, 20, 5]  # rows of the 4 tables
IDS = 3  # ids per table (multi-hot)
PER_CELL = [[0, n - 1] for n in CARDINALITIES for _ in range(IDS)]


class _Dlrm(nn.Module):
    """DLRM's sparse features: ``sparse[:, i]`` into table ``i``, the table's rows summed per sample (an
    ``nn.EmbeddingBag(mode="sum")``, written as an ``nn.Embedding`` and ``sum(1)``: the same layout, without the
    Loop ONNX Runtime runs an EmbeddingBag's export through)."""

    def __init__(self) -> None:
        super().__init__()
        self.tables = nn.ModuleList(nn.Embedding(n, 4) for n in CARDINALITIES)
        self.head = nn.Linear(4 * len(CARDINALITIES), 1)

    def forward(self, sparse: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([t(sparse[:, i]).sum(1) for i, t in enumerate(self.tables)], 1))


def dlrm_ids(rows: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """``rows`` samples of ``sparse``: each table's ids within its own rows."""
    return torch.stack([torch.randint(0, n, (rows, IDS), generator=generator) for n in CARDINALITIES], 1)


def dlrm_graph(tmp_path: Path) -> onnx.ModelProto:
    """The ONNX graph of :class:`_Dlrm`, batch dynamic."""
    path = tmp_path / "dlrm.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the TorchScript exporter: fast; dynamo writes the same
        torch.onnx.export(
            _Dlrm().eval(),
            (dlrm_ids(2),),
            str(path),
            input_names=["sparse"],
            output_names=["y"],
            dynamic_axes={"sparse": {0: "batch"}, "y": {0: "batch"}},
            dynamo=False,
        )
    return onnx.load(str(path))


def _past_table_3() -> np.ndarray:
    """Two samples within every table, but for an id of 10 in table 3 (5 rows), its first id, of the second."""
    sparse = np.zeros((2, len(CARDINALITIES), IDS), np.int64)
    sparse[1, 3, 0] = 10
    return sparse


def test_tables_on_axis_1_take_a_range_per_cell(tmp_path: Path) -> None:
    """Each of a table's 3 ids takes its own table's rows (the input's one range was the 1000-row table's, which let
    10 through to table 3 and ONNX Runtime's Gather traceback); the value past is named by its cell."""
    graph = dlrm_graph(tmp_path)
    assert index_ranges(graph) == {"sparse": PER_CELL}
    with pytest.raises(Exception, match="idx=10 must be within the inclusive range"):
        ort.InferenceSession(graph.SerializeToString()).run(None, {"sparse": _past_table_3()})
    assert outside_index(graph, {"sparse": _past_table_3()}, "dlrm.onnx") == (
        "input 'sparse' holds 10 at sparse[..., 3, 0]: dlrm.onnx indexes an axis of 5 positions with it "
        "(values 0 to 4, or down to -5 counted from its end)"
    )
    assert outside_index(graph, {"sparse": dlrm_ids(8).numpy()}, "dlrm.onnx") is None


def test_the_engine_refuses_an_id_past_its_own_table_naming_the_cell(tmp_path: Path) -> None:
    """kiln-engine.json holds a range per cell, each cell's low from the data's own (table 1's ids counted from its
    end down to -2): the engine refuses 10 in table 3 by its cell before ONNX Runtime sees it. A record of an older
    Kiln, one range per column of the last axis, still holds each column of every table to its own."""
    taken = [TensorSpec(name="sparse", shape=["batch", len(CARDINALITIES), IDS], dtype="int64")]
    seen = [[-2 if 3 <= cell < 6 else 0, high] for cell, (_, high) in enumerate(PER_CELL)]  # table 1 from its end
    ranges = _index_ranges(dlrm_graph(tmp_path), taken, {"sparse": seen})
    assert ranges == {"sparse": seen}
    meta = EngineMetadata.model_construct(name="dlrm", index_ranges=ranges)
    assert meta.outside_values({"sparse": dlrm_ids(8).numpy()}) is None
    assert meta.outside_values({"sparse": _past_table_3()}) == (
        "input 'sparse' holds 10 at sparse[..., 3, 0]: engine dlrm takes values from 0 to 4 there (the positions "
        "of the axis it indexes: a table's rows, a graph's nodes)"
    )
    older = EngineMetadata.model_construct(name="old", index_ranges={"sparse": [[0, 9], [0, 9], [0, 4]]})
    assert older.outside_values({"sparse": _past_table_3()}) == (
        "input 'sparse' holds 10 in column 0 (sparse[..., 0]): engine old takes values from 0 to 9 there (the "
        "positions of the axis it indexes: a table's rows, a graph's nodes)"
    )


def _shared_graph() -> onnx.ModelProto:
    """``sparse [batch, 2, 3]``: ``sparse[:, 0]`` into a 10-row table, ``sparse[:, 1]`` into a 5-row one, and the
    whole input, each column of its last axis shifted by its offset (0, 4, 8), into a shared 12-row table."""
    const = {
        "c0": np.array(0, np.int64),
        "c1": np.array(1, np.int64),
        "offsets": np.array([0, 4, 8], np.int64),
    }
    tables = {"t0": np.zeros((10, 2), np.float32), "t1": np.zeros((5, 2), np.float32)}
    tables["shared"] = np.zeros((12, 2), np.float32)
    nodes = [
        helper.make_node("Gather", ["sparse", "c0"], ["ids0"], axis=1),
        helper.make_node("Gather", ["sparse", "c1"], ["ids1"], axis=1),
        helper.make_node("Gather", ["t0", "ids0"], ["e0"]),
        helper.make_node("Gather", ["t1", "ids1"], ["e1"]),
        helper.make_node("Add", ["sparse", "offsets"], ["rows"]),
        helper.make_node("Gather", ["shared", "rows"], ["e2"]),
    ]
    inits = [numpy_helper.from_array(v, k) for k, v in {**const, **tables}.items()]
    inputs = [helper.make_tensor_value_info("sparse", onnx.TensorProto.INT64, ["batch", 2, 3])]
    outputs = [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in ("e0", "e1", "e2")]
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_a_shift_per_column_of_the_last_axis_bounds_each_cell() -> None:
    """Cell (t, j) takes table t's rows and what the shared table leaves column j after its offset: 0 to 3 in
    column 2 of either table (12 rows less 8), 0 to 7 in column 1 of table 0 (10 rows, 12 less 4)."""
    assert index_ranges(_shared_graph()) == {"sparse": [[0, 9], [0, 7], [0, 3], [0, 4], [0, 4], [0, 3]]}
