"""`kiln precision FILE --calibration data.npz` of a graph network in the batch-of-one layout (docs/byom.md): its
graph takes a symbolic batch axis yet reads row 0 only (its output's axis 0 is a fixed 1), so every graph of the
data is calibrated and checked in a batch of its own; and where Kiln cuts the graphs to a validated node count, the
fix says that Kiln resized them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests.calibration.gnn_graph import gcn_onnx, graphs
from tests.pipeline.test_faults import assert_clean, invoke


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float((a * b).sum() / np.linalg.norm(a) / np.linalg.norm(b))


def test_int8_of_a_batch_of_one_graph_network_calibrates_on_every_graph(tmp_path: Path) -> None:
    """Graph 0 of the data is on a tenth of the others' scale: scales from it alone clip every other graph."""
    import onnxruntime as ort

    model, out, cal = gcn_onnx(tmp_path / "gcn.onnx"), tmp_path / "v", tmp_path / "cal.npz"
    data = graphs(12, 16, 40)
    data["x"][0] *= 0.1
    np.savez(cal, **data)
    result = invoke("precision", model, "-o", out, "--variants", "int8", "--calibration", cal)
    assert result.exit_code == 0, result.output
    int8 = json.loads((out / "variants.json").read_text())["variants"]["int8"]
    assert int8["report"]["calibration"]["batches"] == 12  # a batch of its one graph each
    fresh = graphs(1, 16, 40, seed=7)
    want = ort.InferenceSession(str(model)).run(None, fresh)[0]
    got = ort.InferenceSession(str(out / int8["path"])).run(None, fresh)[0]
    assert _cosine(want, got) > 0.999


def test_calibration_graphs_cut_to_a_validated_node_count_are_said_to_be_cut_by_kiln(tmp_path: Path) -> None:
    """Graphs of 12 nodes validated at 8 and 16 nodes: cut to 8, edges to nodes 8 to 11 index nodes cut away, which
    the graph refuses; the fix says Kiln resized them and names the sizes, not the axes' names."""
    model, cal = gcn_onnx(tmp_path / "gcn.onnx"), tmp_path / "cal.npz"
    np.savez(cal, **graphs(4, 12, 30))
    shapes = "signature.shapes={nodes: [8, 16]}"
    result = invoke(
        "precision", model, "-o", tmp_path / "v", "--variants", "int8", "--calibration", cal, "--set", shapes
    )
    assert_clean(
        result,
        2,
        "ONNX Runtime cannot run the reference",
        "Kiln resized the --calibration rows from their own sizes (nodes=12",
        "give --calibration rows at a validated size (nodes=8",
    )
