"""One pipeline run per workdir at a time.

Two runs on one workdir would clear each other's staging folders (a run removes the staging left by an
interrupted one before it starts) and race on the same stage outputs. An advisory ``flock`` on
``<workdir>/.kiln.lock`` is held for the whole run; the kernel drops it when the process ends, however it
ends, so a crash never leaves a stale lock behind. Where ``fcntl`` does not exist (Windows) runs are not locked.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from pipeline.errors import WorkdirBusy

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

LOCK_NAME = ".kiln.lock"


@contextmanager
def workdir_lock(workdir: Path) -> Iterator[None]:
    workdir.mkdir(parents=True, exist_ok=True)
    if fcntl is None:  # pragma: no cover
        yield
        return
    with open(workdir / LOCK_NAME, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            raise WorkdirBusy(f"workdir {workdir} is in use by another kiln run ({holder})",
                              hint="wait for that run to finish, or give this one its own --workdir") from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()}\n")
        f.flush()
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
