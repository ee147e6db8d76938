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


def test_rows_at_their_own_sizes_get_the_fix_that_names_the_sizes_run() -> None:
    """Axes of different sizes cannot be named alike: the fix asks for sizes the graph takes, naming those run."""
    own = {"nodes": 150, "edges": 600}
    err = reference_error(RuntimeError("bad"), _fed(150, 600), "model.onnx", AXES, _fed(300, 1200), "validation", own)
    assert "resized" not in err.hint and "dynamic_axes" not in err.hint
    assert err.hint == (
        "give signature.shapes sizes the graph takes (it was run at nodes=300, edges=1200; a position table "
        "shorter than that refuses it)"
    )


def test_axes_already_named_alike_are_not_asked_to_be_named_alike() -> None:
    """A DeBERTa's three inputs share one seq axis; a position table shorter than the sizes validated refuses them:
    naming the axes alike, as they already are, fixes nothing."""
    axes = {name: {1: "seq"} for name in ("input_ids", "attention_mask", "token_type_ids")}
    fed = {name: np.zeros((2, 128), np.int64) for name in axes}
    err = reference_error(RuntimeError("broadcast 64 by 128"), fed, "the ONNX file m.onnx", axes, fed)
    assert err.hint.startswith("give signature.shapes sizes the graph takes (it was run at seq=128")
    assert "name alike" not in err.hint
