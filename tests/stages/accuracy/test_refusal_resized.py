"""A reference that refuses rows Kiln resized to a validated size: the fix says Kiln resized them, from which sizes
to which, and asks for rows at a validated size or for validated sizes that include the rows' own."""

from __future__ import annotations

import numpy as np

from kiln.stages.accuracy.refusal import reference_error

AXES = {"x": {1: "nodes"}, "edge_index": {2: "edges"}}


def _fed(nodes: int, edges: int) -> dict[str, np.ndarray]:
    return {"x": np.zeros((1, nodes, 4), np.float32), "edge_index": np.zeros((1, 2, edges), np.int64)}


def test_rows_cut_by_kiln_are_said_to_be_cut_with_their_own_sizes() -> None:
    own = {"nodes": 180, "edges": 800}
    failed = RuntimeError("ScatterND: invalid indice found, indice = 162")
    err = reference_error(failed, _fed(150, 600), "model.onnx", AXES, _fed(300, 1200), "--calibration", own)
    assert "ONNX Runtime cannot run the reference, model.onnx, on the --calibration inputs" in err.message
    assert err.hint.startswith(
        "Kiln resized the --calibration rows from their own sizes (nodes=180, edges=800) to the validated sizes "
        "(nodes=150, edges=600)"
    )
    assert "give --calibration rows at a validated size (nodes=150, edges=600)" in err.hint
    assert "signature.shapes that include the rows' own sizes (nodes=180, edges=800)" in err.hint
    assert "dynamic_axes" not in err.hint  # nothing to name alike: the axes have sizes of their own


def test_rows_at_their_own_sizes_keep_the_fix_that_names_axes_alike() -> None:
    own = {"nodes": 150, "edges": 600}
    err = reference_error(RuntimeError("bad"), _fed(150, 600), "model.onnx", AXES, _fed(300, 1200), "validation", own)
    assert "resized" not in err.hint and "signature.dynamic_axes" in err.hint
