"""One pipeline run per workdir at a time.

Two runs on one workdir would clear each other's staging folders (a run removes the staging left by an
interrupted one before it starts) and race on the same stage outputs. An advisory ``flock`` on
``<workdir>/.kiln.lock`` is held for the whole run; the kernel drops it when the process ends, however it
ends, so a crash never leaves a stale lock behind (the file stays, naming a dead process; the next run takes it).
A link at the lock's path is refused, never followed. Where ``fcntl`` does not exist (Windows) or the
filesystem cannot lock, runs are not locked.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from kiln.core.errors import InputFileError, WorkdirBusy
from kiln.core.ownership import open_nofollow, refuse_link

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

LOCK_NAME = ".kiln.lock"
log = logging.getLogger("kiln.workdir")


BUSY = {errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES}  # what flock(LOCK_NB) reports for a held lock


@contextmanager
def workdir_lock(workdir: Path) -> Iterator[None]:
    lock = workdir / LOCK_NAME
    if lock.exists() and not lock.is_file():  # something else stands where Kiln keeps its lock: never removed
        raise InputFileError(
            f"{lock} is not a file (Kiln keeps its run lock there)",
            hint=f"move {lock} away, or choose another --workdir",
        )
    refuse_link(lock, "the workdir's lock")  # someone else's link: never followed, never truncated
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        fd = open_nofollow(lock, os.O_RDWR | os.O_CREAT | os.O_APPEND)
        f = os.fdopen(fd, "a+", errors="replace")  # a damaged lock file's text is only shown, never trusted
    except OSError as exc:
        raise InputFileError(
            f"cannot write in workdir {workdir}: {exc.strerror}", hint="choose a writable --workdir"
        ) from None
    with f:
        if not _try_lock(f, workdir):
            f.seek(0)
            holder = f.read().strip() or "another process"
            raise WorkdirBusy(
                f"workdir {workdir} is in use by another kiln run ({holder})",
                hint="wait for that run to finish, or give this one its own --workdir",
            )
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        f.flush()
        yield  # the lock goes with the file's close (or the process's end)


def _try_lock(f: IO[str], workdir: Path) -> bool:
    """False if another process holds the lock. Where the filesystem has no locks at all (NFS without lockd,
    some FUSE mounts), run unlocked with a warning rather than refuse to work."""
    if fcntl is None:  # pragma: no cover - Windows
        return True
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in BUSY:
            return False
        log.warning("workdir %s cannot be locked (%s); make sure no other kiln run uses it", workdir, exc.strerror)
    return True
