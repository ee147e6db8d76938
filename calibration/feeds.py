"""Calibration batches on disk, for stages after the precision stage: the torch backend calibrates FP8/INT8 scales
on the PyTorch model itself, from the same batches the precision stage calibrated the ONNX graphs with, and runs
the model on their rows while it builds (capture, checks, warm-up) rather than on random inputs.

One ``.npz`` of ``"<batch>/<input>"`` arrays, the inputs named as the graph names them; numpy only, so reading it
imports no framework.
"""

from __future__ import annotations

import functools
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


def sample_rows(path: Path, names: list[str], count: int) -> dict[str, np.ndarray] | None:
    """``count`` saved samples of each of ``names``, row i of every input from the same sample, the saved rows
    taken in turn where there are fewer: real inputs for a backend's own runs of the model (random ones can break
    what the model assumes of them, as a box's ``x1 >= x0``). The batches pooled are those at the first one's sizes
    on the other axes, sizes the model takes. None where no saved batch holds every input."""
    stat = path.stat()
    pooled = _pooled(path, tuple(names), stat.st_ino, stat.st_mtime_ns, stat.st_size)
    if pooled is None:
        return None
    return {n: a[np.arange(count) % len(a)] for n, a in pooled.items()}


@functools.lru_cache(maxsize=2)
def _pooled(path: Path, names: tuple[str, ...], *_stamp: int) -> dict[str, np.ndarray] | None:
    """The saved batches of ``names`` at the first one's sizes, concatenated; read once per file version
    (``_stamp``: its inode, modification time and size), since a build asks at each batch size it runs."""
    feeds = [f for f in load_feeds(path, list(names)) if all(len(a) for a in f.values())]
    if not feeds:
        return None
    same = [f for f in feeds if all(f[n].shape[1:] == feeds[0][n].shape[1:] for n in names)]
    return {n: np.concatenate([f[n] for f in same]) for n in names}
