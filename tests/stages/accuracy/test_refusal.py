"""kiln.stages.accuracy.refusal: a reference that refuses the validated shapes because an axis left out of
``signature.dynamic_axes`` stayed at the data's own size beside a named one set apart: the fix names it."""

from __future__ import annotations

import numpy as np

from kiln.stages.accuracy.refusal import reference_error


def _fed(ids: int, mask: int) -> dict[str, np.ndarray]:
    return {"ids": np.zeros((8, ids), np.int32), "mask": np.zeros((8, mask), bool)}


def test_an_axis_left_out_beside_a_named_one_of_its_size_is_named_in_the_fix() -> None:
    """Before: "give signature.shapes sizes the graph takes (it was run at seq=12; a position table shorter than
    that refuses it)", where the mask, unnamed in the file and left out of the config, stayed at 12 beside ids at 3."""
    failed = RuntimeError("Attempting to broadcast an axis by a dimension other than 1. 3 by 12")
    err = reference_error(failed, _fed(3, 12), "model.onnx m.onnx", {"ids": {1: "seq"}}, _fed(12, 12))
    assert err.hint.startswith(
        "signature.dynamic_axes leaves out input 'mask' axis 1, kept at the data's own size while 'seq' varied: "
        "where it follows 'seq', name it alike: --set 'signature.dynamic_axes={ids: {1: seq}, mask: {1: seq}}'"
    )
    assert err.hint.endswith(
        "; or give signature.shapes sizes the graph takes (it was run at seq=12; a position "
        "table shorter than that refuses it)"
    )


def test_axes_left_out_of_other_sizes_or_at_their_largest_are_not_named() -> None:
    """A mask of another length, or every named axis at its largest (nothing was set apart), is no left-out axis."""
    axes = {"ids": {1: "seq"}}
    for fed, largest in ((_fed(3, 7), _fed(12, 7)), (_fed(12, 12), _fed(12, 12))):
        err = reference_error(RuntimeError("bad"), fed, "model.onnx m.onnx", axes, largest)
        assert "leaves out" not in err.hint
