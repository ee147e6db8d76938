"""The batch axis of a taken ``model.onnx`` whose inputs name their first axes apart.

Exporters name dynamic axes per input unless told otherwise (torch.onnx.export's list form gives
``input_ids_dynamic_axes_1`` and ``attention_mask_dynamic_axes_1``, tf2onnx ``unk__1`` and ``unk__2``), and Kiln ties
axes by name only, so such a BERT would take its ids and its mask in counts of their own and be served one request
at a time. A two-tower model's ``texts`` and ``images`` really are apart. Which one a file is, running it tells: a
graph that refuses its inputs in different counts takes them as one batch, whose axes get one name in Kiln's copy.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from kiln.core.onnx_io import load_onnx, ort_session, save_onnx

log = logging.getLogger("kiln.export")


def first_axis_names(path: Path) -> dict[str, str]:
    """Input name -> the name of its first axis, for the inputs whose first axis is symbolic."""
    graph = load_onnx(path, load_external_data=False).graph
    dims = {i.name: i.type.tensor_type.shape.dim for i in graph.input}
    return {name: d[0].dim_param for name, d in dims.items() if d and d[0].dim_param}


def tie_batch_axes(path: Path, feed: dict[str, np.ndarray]) -> dict[str, str]:
    """Rename, in the file at ``path``, the first axes of inputs that the graph refuses to take in counts other than
    the first input's to that input's first-axis name; returns the renames (old name -> new). ``feed``: at least
    two rows of every input, which the graph answers (else nothing is probed)."""
    names = first_axis_names(path)
    groups = list(dict.fromkeys(names.values()))
    if len(groups) < 2 or any(len(v) < 2 for v in feed.values()):
        return {}
    session = ort_session(path)
    if not _runs(session, feed):
        return {}
    tied = {g: groups[0] for g in groups[1:] if not _runs(session, _uneven(feed, names, g))}
    if tied:
        _rename(path, tied)
        log.info(
            "inputs' first axes %s are the batch axis '%s' (the graph takes them in one count)", sorted(tied), groups[0]
        )
    return tied


def _uneven(feed: dict[str, np.ndarray], names: dict[str, str], group: str) -> dict[str, np.ndarray]:
    """``feed`` with the inputs whose first axis is called ``group`` at two rows and the others at three (their rows
    repeated): counts that differ and that no broadcast of a single row joins."""
    return {k: np.take(v, np.arange(2 if names.get(k) == group else 3) % len(v), axis=0) for k, v in feed.items()}


def _runs(session: object, feed: dict[str, np.ndarray]) -> bool:
    try:
        session.run(None, feed)  # type: ignore[attr-defined]
    except Exception:  # ONNX Runtime's own error: the graph does not take these shapes together
        return False
    return True


def _rename(path: Path, renames: dict[str, str]) -> None:
    model = load_onnx(path)  # with its weights: the save writes them again where they were external
    for value in [*model.graph.input, *model.graph.output, *model.graph.value_info]:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param in renames:
                dim.dim_param = renames[dim.dim_param]
    save_onnx(model, path)
