"""One pipeline run per workdir at a time.

Two runs on one workdir would clear each other's staging folders (a run removes the staging left by an
interrupted one before it starts) and race on the same stage outputs. An advisory ``flock`` on
``<workdir>/.kiln.lock`` is held for the whole run; the kernel drops it when the process ends, however it
ends, so a crash never leaves a stale lock behind (the file stays, naming a dead process; the next run takes it).
A link at the lock's path is refused, never followed. Where ``fcntl`` does not exist (Windows) or the
filesystem cannot lock, runs are not locked.

``kiln serve`` of a workdir holds the same lock, shared (:func:`served_workdir`): a run would rebuild the package
under a server that goes on answering with the engines it loaded before, and a server started during a run would
serve the package the run is about to replace. So a run refuses a served workdir and a server refuses a workdir a
run holds, each naming the other's process; servers of one workdir share it. Each server appends a line naming
itself to the lock file; lines of dead processes are ignored, and the next run's own line replaces them all.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from kiln.core.errors import InputFileError, WorkdirBusy
from kiln.core.ownership import open_nofollow, pid_alive, refuse_link

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

LOCK_NAME = ".kiln.lock"
SERVED_BY = "kiln serve pid"  # a server's line in the lock file: "kiln serve pid <pid> on <host>"
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
            servers, holder = _holders(f)
            if servers:
                raise WorkdirBusy(
                    f"workdir {workdir} is being served by kiln serve (pid {', '.join(servers)})",
                    hint="stop the server first, or run into another workdir with -w",
                )
            raise WorkdirBusy(
                f"workdir {workdir} is in use by another kiln run ({holder or 'another process'})",
                hint="wait for that run to finish, or give this one its own --workdir",
            )
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        f.flush()
        yield  # the lock goes with the file's close (or the process's end)


@contextmanager
def served_workdir(workdir: Path) -> Iterator[bool]:
    """Mark ``workdir`` as served for the block: its lock held shared, this process named in it (``kiln serve``).
    A run holding the workdir is refused (:class:`WorkdirBusy`, naming it); other servers of the workdir are not.
    Where the lock cannot be opened for writing or locked (a read-only workdir, a filesystem without locks), the
    workdir is served unmarked (said in the debug log). Yields whether it is marked."""
    lock = workdir / LOCK_NAME
    try:
        if lock.is_symlink() or (lock.exists() and not lock.is_file()):
            raise OSError(errno.EEXIST, "not a regular file")
        fd = open_nofollow(lock, os.O_RDWR | os.O_CREAT | os.O_APPEND)
        f = os.fdopen(fd, "a+", errors="replace")
    except OSError as exc:
        log.debug("workdir %s served unmarked: cannot write its lock %s (%s)", workdir, lock, exc.strerror)
        yield False
        return
    with f:
        if not _try_lock(f, workdir, shared=True):
            _, holder = _holders(f)
            if not _try_lock(f, workdir, shared=True):  # again: the last server out holds it alone for a moment
                raise WorkdirBusy(
                    f"workdir {workdir} is in use by a kiln run ({holder or 'another process'}), which may "
                    "replace the engines served",
                    hint="wait for that run to finish and serve the workdir then, or serve another workdir",
                )
        try:
            f.write(f"{SERVED_BY} {os.getpid()} on {socket.gethostname()}\n")
            f.flush()
        except OSError as exc:  # locked all the same: a run is refused, naming no process
            log.debug("workdir %s: this server could not be named in %s (%s)", workdir, lock, exc.strerror)
        try:
            yield True  # the mark goes with the file's close (or the process's end)
        finally:
            _unname_servers(f)


def _unname_servers(f: IO[str]) -> None:
    """The last server out takes the servers' lines out of the lock file (a lock it can take alone shows that no
    other server holds it); while others still serve, the lines stay."""
    if fcntl is None:  # pragma: no cover - Windows
        return
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        f.seek(0)
        kept = [line for line in f.read().splitlines(keepends=True) if not line.startswith(SERVED_BY)]
        f.seek(0)
        f.truncate()
        f.write("".join(kept))
        f.flush()
    except OSError:  # another server holds it too (or a run took it as this one let go): left as it is
        pass


def _holders(f: IO[str]) -> tuple[list[str], str]:
    """Who holds the lock ``f`` could not take: the pids of the live servers named in it, and the run's line (its
    first line that names no server). Read again once after a moment when it names nobody alive: a holder writes
    its line just after taking the lock."""
    for attempt in range(2):
        f.seek(0)
        lines = [line.strip() for line in f.read().splitlines() if line.strip()]
        named = [m for line in lines if (m := _SERVER_LINE.match(line))]
        servers = list(dict.fromkeys(m[1] for m in named if _alive(int(m[1]), m[2])))
        runs = [line for line in lines if not line.startswith(SERVED_BY)]
        run_alive = any((m := _RUN_LINE.match(line)) is None or _alive(int(m[1]), m[2]) for line in runs)
        if servers or run_alive or attempt:
            return servers, runs[0] if runs else ""
        time.sleep(0.1)
    return [], ""  # pragma: no cover - the loop returns


_SERVER_LINE = re.compile(rf"^{SERVED_BY} (\d+) on (\S+)$")
_RUN_LINE = re.compile(r"^pid (\d+) on (\S+)$")


def _alive(pid: int, host: str) -> bool:
    """Whether the process a lock line names runs (one of another host: taken as running)."""
    return host != socket.gethostname() or pid_alive(pid)


def _try_lock(f: IO[str], workdir: Path, shared: bool = False) -> bool:
    """False if another process holds the lock (``shared``: holds it exclusively, as a run). Where the filesystem
    has no locks at all (NFS without lockd, some FUSE mounts), run unlocked with a warning rather than refuse to
    work (a server: said in the debug log)."""
    if fcntl is None:  # pragma: no cover - Windows
        return True
    try:
        fcntl.flock(f, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in BUSY:
            return False
        if shared:
            log.debug("workdir %s served unmarked: it cannot be locked (%s)", workdir, exc.strerror)
        else:
            log.warning("workdir %s cannot be locked (%s); make sure no other kiln run uses it", workdir, exc.strerror)
    return True
