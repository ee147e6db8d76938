"""Named input arrays a user hands Kiln in an ``.npz`` file (``--inputs``, ``--calibration``), read and checked
against the inputs a model or engine declares."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from kiln.core.errors import InputFileError
from kiln.core.records import TensorSpec


def read_feed(path: Path, specs: list[TensorSpec], taker: str = "the engine") -> dict[str, np.ndarray]:
    """The arrays of an ``.npz`` keyed by the input names of ``taker`` (an engine's ``kiln-engine.json`` "inputs",
    or a model's graph inputs), checked against their declared dtypes and shapes, rows and values."""
    names = [s.name for s in specs]
    hint = f"give an .npz with one array per input: np.savez(path, {', '.join(f'{n}=...' for n in names)})"
    if not path.is_file():
        raise InputFileError(f"inputs file not found: {path}", hint=hint)
    try:
        loaded = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        raise InputFileError(f"cannot read inputs {path}: {exc}", hint=hint) from None
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise InputFileError(f"{path} holds one bare array, not named arrays", hint=hint)
    with loaded:
        try:
            feed = dict(loaded)
        except ValueError as exc:  # an array of Python objects needs pickle, which is never enabled
            raise InputFileError(f"inputs {path} holds pickled objects ({exc})", hint=hint) from None
    if sorted(feed) != sorted(names):
        raise InputFileError(f"inputs {path} has arrays {sorted(feed)}; {taker} takes {sorted(names)}", hint=hint)
    check_feed(feed, specs, str(path), taker)
    return feed


def check_feed(feed: Mapping[str, np.ndarray], specs: list[TensorSpec], source: str, taker: str) -> None:
    """Each array against its input: dtype, rank and fixed sizes, at least one row, one row count, and finite
    values (a NaN in the data would otherwise surface as a failed gate or a skipped training step)."""
    for spec in specs:
        _check_array(spec, np.asarray(feed[spec.name]), source, taker)
    counts = {spec.name: len(feed[spec.name]) for spec in specs}
    if len(set(counts.values())) > 1:
        raise InputFileError(
            f"the inputs in {source} have different row counts {counts}", hint="give every input one row per sample"
        )


def _check_array(spec: TensorSpec, array: np.ndarray, source: str, taker: str) -> None:
    want = [d if isinstance(d, int) and d >= 1 else None for d in spec.shape]
    shape_ok = array.ndim == len(want) and all(w is None or w == d for w, d in zip(want, array.shape))
    if array.dtype == np.dtype(spec.dtype) and _only_the_fixed_batch_differs(want, array.shape):
        raise InputFileError(
            f"input '{spec.name}' in {source} has {array.shape[0]} rows; {taker} fixes its batch axis at {want[0]} "
            f"({spec.dtype}{list(spec.shape)})",
            hint=f"give {want[0]} rows, or export the model with a dynamic batch axis (`kiln run` with model.onnx "
            "makes a fixed batch axis symbolic where the graph allows it)",
        )
    if array.dtype != np.dtype(spec.dtype) or not shape_ok:
        dims = ", ".join(str(w) if w is not None else str(d) for w, d in zip(want, spec.shape))
        raise InputFileError(
            f"input '{spec.name}' in {source} is {array.dtype}{list(array.shape)}; {taker} takes {spec.dtype}[{dims}]",
            hint=f"give it as {spec.dtype}[{dims}]" + (f", e.g. x.astype('{spec.dtype}')" if shape_ok else ""),
        )
    if array.ndim and len(array) == 0:
        raise InputFileError(f"input '{spec.name}' in {source} has no rows", hint="give at least one sample")
    bad = _non_finite(array)
    if bad:
        raise InputFileError(
            f"input '{spec.name}' in {source} holds {bad}", hint="clean or drop those samples before handing them over"
        )


def _only_the_fixed_batch_differs(want: list[int | None], shape: tuple[int, ...]) -> bool:
    """Whether an array fits its input but for the rows on a batch axis the graph fixed to a number."""
    if len(want) != len(shape) or not want or want[0] is None or want[0] == shape[0]:
        return False
    return all(w is None or w == d for w, d in zip(want[1:], shape[1:]))


def _non_finite(array: np.ndarray) -> str:
    """'3 NaN and 1 infinite values' (empty when every value is finite, or the dtype has no such values)."""
    if not np.issubdtype(array.dtype, np.floating) and not np.issubdtype(array.dtype, np.complexfloating):
        return ""
    nan = int(np.isnan(array).sum())
    inf = int(np.isinf(array).sum())
    parts = [f"{nan} NaN" if nan else "", f"{inf} infinite" if inf else ""]
    return " and ".join(p for p in parts if p) + " values" if nan or inf else ""
