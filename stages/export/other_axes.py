"""The axes besides the batch of a taken ``model.onnx`` whose inputs name them apart, though the graph takes them at
one size only.

Exporters name each dynamic axis per input unless told otherwise (tf2onnx gives a BERT's ``input_ids`` and
``attention_mask`` sequence axes ``unk__1`` and ``unk__3``, torch.onnx.export's list form ``input_ids_dynamic_axes_2``
and ``attention_mask_dynamic_axes_2``), and Kiln tells axes apart by name, so validation would feed the ids at one
length beside the mask at another, which the graph refuses. Only names an exporter made up (:data:`MADE_NAME`) are
tied, and only where running the graph says so: the finest grouping of those names (of one size in the data) that the
graph runs with each group at a size of its own is the truth, and the names of a group become its first one in
Kiln's copy. An encoder-decoder's source and target lengths, which it runs apart, stay apart.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx

from kiln.core.labels import exporter_made
from kiln.core.onnx_io import load_onnx, ort_session, save_onnx, session_options
from kiln.stages.export.batch_axes import first_axis_names, partitions

log = logging.getLogger("kiln.export")
MAX_NAMES = 5  # exporter-made names of one size told apart by running the graph: Bell(5) = 52 runs at most

Places = dict[str, list[tuple[str, int]]]  # axis name -> the (input, axis) pairs that carry it


def made_axes(graph: onnx.GraphProto) -> Places:
    """Each exporter-made name (:func:`kiln.core.labels.exporter_made`) of an input's axis besides the first, with the
    inputs and axes that carry it; names an input's first axis carries are the batch's (:mod:`.batch_axes`)."""
    batch = set(first_axis_names(graph).values())
    out: Places = {}
    for value in graph.input:
        for axis, dim in enumerate(value.type.tensor_type.shape.dim):
            name = dim.dim_param
            if axis and name and name not in batch and exporter_made(name):
                out.setdefault(name, []).append((value.name, axis))
    return out


def same_size_names(places: Places, feed: dict[str, np.ndarray]) -> list[list[str]]:
    """The names of ``places`` grouped by the one size ``feed`` gives each at all its places (a name fed at two sizes,
    or at an input the feed lacks, is left out): only names of one size in the data can be one axis. Groups of
    one name, or of more than :data:`MAX_NAMES`, are left out too."""
    by_size: dict[int, list[str]] = {}
    for name, where in places.items():
        sizes = {feed[i].shape[axis] for i, axis in where if i in feed and feed[i].ndim > axis}
        if len(sizes) == 1 and len(where) == sum(i in feed for i, _ in where):
            by_size.setdefault(sizes.pop(), []).append(name)
    return [names for names in by_size.values() if 2 <= len(names) <= MAX_NAMES]


def resized(feed: dict[str, np.ndarray], places: Places, blocks: list[list[str]]) -> dict[str, np.ndarray]:
    """``feed`` with the axes of each group of ``blocks`` at a size of its own: the first group's as fed, the others
    shorter by one each (positions cut off the end), or longer (positions repeated) where the fed size is too small
    to shorten to 2 or more (a size of 1 would broadcast)."""
    out = dict(feed)
    for i, block in enumerate(blocks):
        for name in block:
            for k, axis in places[name]:
                size = out[k].shape[axis]
                want = size - i if size - (len(blocks) - 1) >= 2 else size + i
                out[k] = np.take(out[k], np.arange(want) % size, axis=axis)
    return out


def tie_other_axes(path: Path, feed: dict[str, np.ndarray]) -> dict[str, str]:
    """Rename, in the file at ``path``, the exporter-made names of input axes besides the first that the graph takes
    at one size only to one name (the first of each group, in the inputs' order); returns the renames (old name ->
    new). ``feed``: inputs the graph runs on as they are (else nothing is renamed: the stages that run it say why).
    Each group of names is told apart in :data:`MAX_NAMES` runs of the graph or fewer."""
    graph = load_onnx(path, load_external_data=False).graph
    places = made_axes(graph)
    groups = same_size_names(places, feed)
    if not groups:
        return {}
    options = session_options()
    options.log_severity_level = 4  # sizes the graph refuses are an answer here, not an error to log
    session = ort_session(path, options=options)
    if not _runs(session, feed):
        return {}
    renames: dict[str, str] = {}
    for names in groups:
        blocks = next(p for p in partitions(names) if len(p) == 1 or _runs(session, resized(feed, places, p)))
        renames |= {name: block[0] for block in blocks for name in block[1:]}
    if renames:
        _rename(path, renames)
        log.info("%s", _why_tied(renames, places))
    return renames


def _runs(session: object, feed: dict[str, np.ndarray]) -> bool:
    """Whether ONNX Runtime runs the graph on ``feed`` (its error: the graph does not take these sizes together)."""
    try:
        session.run(None, feed)  # type: ignore[attr-defined]
    except Exception:  # ONNX Runtime's own error, whatever its type: the answer sought
        return False
    return True


def _why_tied(renames: dict[str, str], places: Places) -> str:
    """The tie message: each renamed axis, where it lies, and the axis it is now."""
    where = {name: ", ".join(f"{k}[{axis}]" for k, axis in places[name]) for name in places}
    why = [f"'{old}' ({where[old]}) is now '{new}' ({where[new]})" for old, new in sorted(renames.items())]
    return (
        "model.onnx names axes apart that Kiln ties into one, as the graph runs them only at one size: "
        + "; ".join(why)
        + ". The engines take each group of those axes at one size only"
    )


def _rename(path: Path, renames: dict[str, str]) -> None:
    """Give every dim of the graph's inputs, outputs and declared shapes named in ``renames`` its new name."""
    model = load_onnx(path)  # with its weights: the save writes them again where they were external
    for value in [*model.graph.input, *model.graph.output, *model.graph.value_info]:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param in renames:
                dim.dim_param = renames[dim.dim_param]
    save_onnx(model, path)
