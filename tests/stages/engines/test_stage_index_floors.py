"""An engine built from a graph whose node axis is dynamic records where its edge indices start, and refuses one
below it that ONNX Runtime would count from the end."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from kiln.core.errors import InputError
from kiln.core.records import TensorSpec
from kiln.stages.engines import stage
from kiln.stages.engines.registry import load_engine
from tests.core.test_index_ranges import _gin_graph


def test_floors_start_at_0_unless_the_data_counts_from_the_end() -> None:
    taken = [TensorSpec(name="edge_index", shape=["batch", 2, 6], dtype="int64")]
    graph = _gin_graph(nodes_axis="nodes")
    assert stage._index_floors(graph, taken, {}) == {"edge_index": 0}
    assert stage._index_floors(graph, taken, {"edge_index": [0, 199]}) == {"edge_index": 0}
    assert stage._index_floors(graph, taken, {"edge_index": [-3, 199]}) == {"edge_index": -3}
    assert stage._index_floors(graph, [], {}) == {}


def test_an_engine_over_a_dynamic_node_axis_refuses_a_negative_node_id(tmp_path: Path) -> None:
    onnx.save(_gin_graph(nodes_axis="nodes"), tmp_path / "gin.onnx")
    meta = stage.build_engine(
        tmp_path / "gin.onnx",
        tmp_path / "e",
        "onnxruntime",
        "cpu",
        "fp32",
        stage.BuildConfig(),
        tmp_path / "cache",
        axis_sizes={"nodes": [4, 16]},
    )
    assert meta.index_floors == {"edge_index": 0} and meta.index_ranges == {}
    x, edges = np.ones((1, 12, 4), np.float32), np.zeros((1, 2, 6), np.int64)
    with load_engine(tmp_path / "e") as engine:
        assert engine.infer({"x": x, "edge_index": edges})["agg"].shape == (1, 12, 4)
        edges[0, 0, 2] = -1
        with pytest.raises(InputError, match=r"'edge_index' holds -1 at edge_index\[0, 0, 2\].*from 0"):
            engine.infer({"x": x, "edge_index": edges})
