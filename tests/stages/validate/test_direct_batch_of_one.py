"""`kiln validate ENGINE --inputs` of a graph network in the batch-of-one layout (docs/byom.md): its graph takes a
symbolic batch axis yet reads row 0 only (its output's axis 0 is a fixed 1), so each graph of the file is run in a
call of its own, on the engine and on the reference, and every graph is compared."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests.calibration.gnn_graph import gcn_onnx, graphs
from tests.pipeline.test_faults import invoke


def _three_graphs(tmp_path: Path) -> Path:
    """3 graphs of positive features but the last, whose are negative (a ReLU at the end changes only that one)."""
    data = graphs(3, 12, 30)
    data["x"][2] *= -1
    path = tmp_path / "graphs.npz"
    np.savez(path, **data)
    return path


def test_every_graph_of_the_inputs_is_compared_and_timed_one_a_call(tmp_path: Path) -> None:
    model, engine = gcn_onnx(tmp_path / "gcn.onnx"), tmp_path / "e"
    assert invoke("build", model, "-o", engine).exit_code == 0
    out = invoke("validate", engine, "--reference", model, "--inputs", _three_graphs(tmp_path))
    assert out.exit_code == 0, out.output
    result = json.loads(out.output[out.output.index("{") : out.output.rindex("}") + 1])
    assert result["passed"] and list(result["latency_ms"]) == ["1"]  # the batch timed: one graph


def test_a_reference_that_differs_on_the_last_graph_only_fails(tmp_path: Path) -> None:
    """Only graph 0 was computed on either side: a reference that differs from the engine on graph 2 passed."""
    engine = tmp_path / "e"
    assert invoke("build", gcn_onnx(tmp_path / "gcn.onnx"), "-o", engine).exit_code == 0
    reference = gcn_onnx(tmp_path / "relu" / "gcn.onnx", relu=True)
    out = invoke("validate", engine, "--reference", reference, "--inputs", _three_graphs(tmp_path))
    assert out.exit_code != 0, out.output
    assert '"passed": false' in out.output
