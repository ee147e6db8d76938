"""Named input arrays a user hands Kiln in an ``.npz`` file (``--inputs``, ``--calibration``), read and checked
against the inputs a model or engine declares."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kiln.core.errors import InputFileError
from kiln.core.records import TensorSpec


def read_feed(path: Path, specs: list[TensorSpec]) -> dict[str, np.ndarray]:
    """The arrays of an ``.npz`` keyed by the engine's input names, checked against their declared dtypes and
    shapes (``kiln-engine.json`` "inputs")."""
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
        raise InputFileError(f"inputs {path} has arrays {sorted(feed)}; the engine takes {sorted(names)}", hint=hint)
    for spec in specs:
        _check_array(spec, feed[spec.name])
    return feed


def _check_array(spec: TensorSpec, array: np.ndarray) -> None:
    want = [d if isinstance(d, int) and d >= 1 else None for d in spec.shape]
    shape_ok = array.ndim == len(want) and all(w is None or w == d for w, d in zip(want, array.shape))
    if array.dtype != np.dtype(spec.dtype) or not shape_ok:
        dims = ", ".join("batch" if w is None else str(w) for w in want)
        raise InputFileError(
            f"input '{spec.name}' is {array.dtype}{list(array.shape)}; the engine takes {spec.dtype}[{dims}]",
            hint=f"save it as {spec.dtype} with that shape, e.g. x.astype('{spec.dtype}')",
        )
