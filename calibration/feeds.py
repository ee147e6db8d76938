"""Calibration batches on disk, for stages after the precision stage: the torch backend calibrates FP8/INT8 scales
on the PyTorch model itself, from the same batches the precision stage calibrated the ONNX graphs with.

One ``.npz`` of ``"<batch>/<input>"`` arrays, the inputs named as the graph names them; numpy only, so reading it
imports no framework.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

FILE = "calibration.npz"  # in the precision stage's folder


def save_feeds(
    batches: list[np.ndarray | dict[str, np.ndarray]],
    names: list[str],
    path: Path,
    max_rows: int = 128,
    max_bytes: int = 32 << 20,
) -> int:
    """The first batches, up to ``max_rows`` samples and about ``max_bytes``, as feeds into ``path``; returns how
    many batches were saved (one input's batch is an array, several inputs' a feed of named arrays)."""
    arrays: dict[str, np.ndarray] = {}
    total = size = 0
    for i, batch in enumerate(batches):
        feed = {k: np.asarray(v) for k, v in (batch if isinstance(batch, dict) else {names[0]: batch}).items()}
        per_row = max(sum(a[:1].nbytes for a in feed.values()), 1)
        take = min(max_rows - total, (max_bytes - size) // per_row)
        if take <= 0:
            break
        for name, array in feed.items():
            arrays[f"{i}/{name}"] = array[:take]
        rows = len(next(iter(feed.values()))[:take])
        total, size = total + rows, size + rows * per_row
    np.savez(path, **arrays)
    return len({k.split("/")[0] for k in arrays})


def load_feeds(path: Path, names: list[str]) -> list[dict[str, np.ndarray]]:
    """The saved batches that hold every one of ``names``, in order."""
    with np.load(path) as saved:
        count = len({k.split("/")[0] for k in saved.files})
        return [
            {n: saved[f"{i}/{n}"] for n in names} for i in range(count) if all(f"{i}/{n}" in saved.files for n in names)
        ]
