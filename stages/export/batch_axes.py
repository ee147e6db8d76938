"""The batch axis of a taken ``model.onnx`` whose inputs name their first axes apart.

Exporters name dynamic axes per input unless told otherwise (torch.onnx.export's list form gives
``input_ids_dynamic_axes_1`` and ``attention_mask_dynamic_axes_1``, tf2onnx ``unk__1`` and ``unk__2``), and Kiln ties
axes by name only, so such a BERT would take its ids and its mask in counts of their own and be served one request
at a time. A two-tower model's ``texts`` and ``images`` really are apart. Which one a file is, running it tells: the
finest grouping of the inputs whose groups the graph takes in counts of their own, less groups whose count no
output carries at any of its axes (a mask the graph broadcasts or slices), is the truth, and the inputs of a group get
one name in Kiln's copy.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx

from kiln.core.onnx_io import load_onnx, ort_session, save_onnx
from kiln.stages.export.graph_inputs import unread_inputs

log = logging.getLogger("kiln.export")
MAX_GROUPS = 5  # first-axis names told apart by running the graph: Bell(5) = 52 runs at most


def first_axis_names(graph: onnx.GraphProto) -> dict[str, str]:
    """Input name -> its first axis's name, for the inputs whose first axis is not a fixed size (one with no name
    is called ``<input>``)."""
    out = {}
    for value in graph.input:
        dims = value.type.tensor_type.shape.dim
        if dims and not dims[0].HasField("dim_value"):
            out[value.name] = dims[0].dim_param or f"<{value.name}>"
    return out


def tie_batch_axes(path: Path, feed: dict[str, np.ndarray]) -> dict[str, str]:
    """Rename, in the file at ``path``, the first axes of inputs the graph takes only in one count to one name
    (:func:`batch_ties`); returns the renames (old name -> new)."""
    renames = batch_ties(path, feed)
    if renames:
        write_ties(path, path, renames)
    return renames


def batch_ties(path: Path, feed: dict[str, np.ndarray]) -> dict[str, str]:
    """The renames (old name -> new) that give the first axes of inputs the graph at ``path`` takes only in one
    count one name (the first input's of each group), without changing the file. Inputs whose values the graph
    never reads join the first group: their count changes nothing. ``feed``: at least two rows of every input whose
    first axis is dynamic, which the graph answers in one count (else nothing is renamed). Each tie is logged saying
    why: the user named those axes apart, and the engine will refuse them in counts of their own."""
    graph = load_onnx(path, load_external_data=False).graph
    names = first_axis_names(graph)
    unread = set(unread_inputs(graph))
    groups = list(dict.fromkeys(n for k, n in names.items() if k not in unread))
    few = any(len(feed[k]) < 2 for k in names if k in feed)  # of the inputs tied (a scalar input has no rows)
    if len(set(names.values())) < 2 or not groups or len(groups) > MAX_GROUPS or few:
        return {}
    session = ort_session(path)
    runs = ((p, _run(session, _counts(feed, names, p))) for p in partitions(groups))
    blocks, outputs = next(((p, out) for p, out in runs if out is not None), (None, None))
    if blocks is None or outputs is None:  # not even in one count: the data does not fit the graph (said later)
        return {}
    followed = _followed(session, feed, names, blocks, outputs)
    joined = _leading(blocks, followed)
    renames = {name: block[0] for block in joined for name in block if name != block[0]}
    renames |= {names[k]: joined[0][0] for k in unread if k in names and names[k] != joined[0][0]}
    if renames:
        why = _why_tied(path.name, renames, blocks, {names[k]: k for k in unread if k in names})
        # certain ties (an exporter's per-input names on inputs the graph runs in one count) are said quietly; one
        # the graph would have run apart, since no output carries that count, is Kiln's judgement: a warning
        log.log(logging.WARNING if "no output has an axis" in why else logging.INFO, "%s", why)
    return renames


def _why_tied(shown: str, renames: dict[str, str], blocks: list[list[str]], unread: dict[str, str]) -> str:
    """The tie warning: each renamed first axis with the reason the graph gave (it never reads the input, it runs
    the group only in one count with another, or no output carries the group's count at any axis)."""
    block_of = {name: i for i, block in enumerate(blocks) for name in block}
    why = []
    for old, new in sorted(renames.items()):
        if old in unread:
            reason = f"the graph never reads input '{unread[old]}'"
        elif block_of.get(old) == block_of.get(new):
            reason = "the graph runs them only in one count"
        else:
            reason = f"no output has an axis that follows the count of '{old}' (the graph reads it whole)"
        why.append(f"'{old}' is now '{new}' ({reason})")
    return (
        f"{shown} names first axes apart that Kiln ties into one batch axis: "
        + "; ".join(why)
        + ". The engines take those inputs in one count only"
    )


def partitions(items: list[str]) -> Iterator[list[list[str]]]:
    """Every grouping of ``items``, the finest first (most groups), each group in ``items``' order."""
    found: list[list[list[str]]] = []

    def grow(rest: list[str], blocks: list[list[str]]) -> None:
        if not rest:
            found.append([list(b) for b in blocks])
            return
        head, tail = rest[0], rest[1:]
        for block in blocks:
            block.append(head)
            grow(tail, blocks)
            block.pop()
        grow(tail, [*blocks, [head]])

    grow(items, [])
    yield from sorted(found, key=len, reverse=True)


def _counts(
    feed: dict[str, np.ndarray], names: dict[str, str], blocks: list[list[str]], start: int = 2
) -> dict[str, np.ndarray]:
    """``feed`` with each group's inputs at a count of its own (``start``, ``start`` + 1, ...: rows repeated; no
    broadcast of a single row joins them), inputs outside every group (unread, or with a fixed first axis) as they
    are."""
    rows = {name: start + i for i, block in enumerate(blocks) for name in block}
    out = {}
    for k, v in feed.items():
        count = rows.get(names.get(k, ""))
        out[k] = v if count is None else np.take(v, np.arange(count) % len(v), axis=0)
    return out


def _run(session: object, feed: dict[str, np.ndarray]) -> list[np.ndarray] | None:
    """The graph's outputs on ``feed``, or None where ONNX Runtime refuses its shapes together."""
    try:
        return list(session.run(None, feed))  # type: ignore[attr-defined]
    except Exception:  # ONNX Runtime's own error: the graph does not take these shapes together
        return None


def _followed(
    session: object,
    feed: dict[str, np.ndarray],
    names: dict[str, str],
    blocks: list[list[str]],
    outputs: list[np.ndarray],
) -> set[int]:
    """Indices of the ``blocks`` whose count some output carries, at any of its axes (a CLIP score matrix
    ``[images, texts]`` carries the texts' count at axis 1). ``outputs``: the graph's at counts 2, 3, ...; a second
    run at other counts tells an axis that follows a count from a fixed size that happens to equal it (3 classes
    beside 3 masks). Where that run fails, the first alone decides."""
    start = 2 + len(blocks)
    again = _run(session, _counts(feed, names, blocks, start))
    pairs = list(zip(outputs, again if again is not None else [None] * len(outputs)))
    return {i for i in range(len(blocks)) if any(_carries(a, b, 2 + i, start + i) for a, b in pairs)}


def _carries(first: np.ndarray, second: np.ndarray | None, count: int, other: int) -> bool:
    """Whether an output has an axis of size ``count`` in ``first`` and ``other`` in ``second`` (the same output at
    the other counts; None or another rank: ``first`` alone)."""
    if second is None or second.ndim != first.ndim:
        return count in first.shape
    return any(a == count and b == other for a, b in zip(first.shape, second.shape))


def _leading(blocks: list[list[str]], followed: set[int]) -> list[list[str]]:
    """``blocks`` with each one whose count no output carries (``followed``: :func:`_followed`) joined to the first
    that one does: a mask taken in another count without an error (a legacy DistilBERT export broadcasts or slices
    it) is the batch's still, where a tower's own inputs lead outputs of their own."""
    leading = [b for i, b in enumerate(blocks) if i in followed]
    if not leading or len(leading) == len(blocks):
        return blocks
    joined = [list(b) for b in leading]
    joined[0] += [name for i, b in enumerate(blocks) if i not in followed for name in b]
    return joined


def write_ties(src: Path, dest: Path, renames: dict[str, str]) -> None:
    """Write the graph at ``src`` to ``dest`` (the same file, or Kiln's copy of a user's) with the first axes of its
    inputs (and every declared shape) under their group's name (``renames``: :func:`batch_ties`); an unnamed one
    (``<input>``) gets its name on that input, the group's first input too where that name is its own."""
    model = load_onnx(src)  # with its weights: the save writes them again where they were external
    names = first_axis_names(model.graph)
    groups = set(renames.values())
    for value in model.graph.input:
        dims = value.type.tensor_type.shape.dim
        old = names.get(value.name)
        if old in renames or old in groups:
            dims[0].dim_param = renames.get(old, old)
    for value in [*model.graph.output, *model.graph.value_info]:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param in renames:
                dim.dim_param = renames[dim.dim_param]
    save_onnx(model, dest)
