"""What a piece of the user's code read: the files it opened and the folders it listed through Python, and whether
it reached past the machine (a socket, a database, a subprocess).

Recorded with Python's audit hooks (:func:`sys.addaudithook`, PEP 578), the one place every ``open()``,
``os.listdir`` and ``socket.connect`` of the interpreter reports to; no library records what a call read, so this is
written here. What a library reads in C (pyarrow's and h5py's files) is not seen: callers let the user name those.
A hook cannot be removed once added, so one is added per process and records only inside :func:`recording`.
"""

from __future__ import annotations

import functools
import os
import site
import sys
import sysconfig
import threading
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib.util import source_from_cache
from pathlib import Path
from types import FrameType
from typing import Any

# Events meaning the code read from something other than the files of this machine
# ...or in another process, whose reads this one's hook does not see (a worker pool, a DataLoader's workers)
REACHES_OUT = {
    "socket.connect",
    "socket.sendto",
    "sqlite3.connect",
    "subprocess.Popen",
    "os.system",
    "os.exec",
    "os.fork",
    "os.forkpty",
    "os.posix_spawn",
    "os.spawn",
}
LISTS = {"os.listdir", "os.scandir", "glob.glob"}


@dataclass
class Reads:
    """Paths read while recording: ``files`` opened for reading (or looked for: one that did not exist is a read of
    its absence), ``folders`` listed (by a glob, say) other than by the import system, the first event that reached
    past the machine's files, if any, and the environment variables read."""

    files: set[str] = field(default_factory=set)
    folders: set[str] = field(default_factory=set)
    reached_out: str | None = None
    environ: set[str] = field(default_factory=set)  # environment variables read through os.environ / os.getenv


_active: list[Reads] = []
_lock = threading.Lock()
_hooked = False


def _hook(event: str, args: tuple[Any, ...]) -> None:
    if not _active:
        return
    try:
        _note(_active[-1], event, args)
    except Exception:  # noqa: BLE001 - an audit hook that raises aborts the user's own call: never
        pass


def _note(reads: Reads, event: str, args: tuple[Any, ...]) -> None:
    if event == "open":
        path, mode, flags = (*args, None, None)[:3]
        if isinstance(path, (str, bytes, os.PathLike)) and _reading(mode, flags):
            reads.files.add(os.fsdecode(path))
    elif event in LISTS:
        path = args[0] if args else "."
        if isinstance(path, (str, bytes, os.PathLike)) and not _from_import_system():
            reads.folders.add(os.fsdecode(path))
    elif (event in REACHES_OUT or event.startswith("os.exec")) and not _importing_a_library():
        reads.reached_out = reads.reached_out or event


def _reading(mode: Any, flags: Any) -> bool:
    """Whether an ``open`` reads what is there: ``open()``'s mode has ``r`` (``r+`` too); ``os.open`` (no mode) is
    not write-only."""
    if mode is not None:
        return "r" in str(mode) or "a+" in str(mode)
    return not (isinstance(flags, int) and flags & (os.O_WRONLY | os.O_TRUNC))


def _from_import_system() -> bool:
    """Whether the import system is listing a folder (to find a module), not the user's code."""
    frame = _caller()
    return frame is not None and frame.f_code.co_filename.startswith("<frozen importlib")


def _caller() -> FrameType | None:
    """The frame whose call raised the audit event: the first one outside this module."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back
    return frame


def _importing_a_library() -> bool:
    """Whether the code running is an installed package's module body being imported (numpy asks ``lscpu`` when it
    is first imported): the environment's doing, which the next run repeats or not, not the user's code reaching
    out. A user's module doing so on import counts."""
    frame = _caller()
    while frame is not None and frame.f_code.co_name != "<module>":
        frame = frame.f_back
    if frame is None or frame.f_back is None or not frame.f_back.f_code.co_filename.startswith("<frozen importlib"):
        return False
    return _installed(frame.f_code.co_filename)


def _installed(filename: str) -> bool:
    real = Path(filename).resolve()
    return any(real.is_relative_to(root) for root in _roots())


@functools.cache
def _roots() -> tuple[Path, ...]:
    return tuple(installed_roots())


@contextmanager
def recording() -> Iterator[Reads]:
    """Record what the code in the ``with`` block reads (in any thread of the process)."""
    global _hooked
    with _lock:
        if not _hooked:
            sys.addaudithook(_hook)
            _hooked = True
    reads = Reads()
    _active.append(reads)
    environ, os.environ = os.environ, _WatchedEnviron(os.environ, reads.environ)  # type: ignore[assignment]  # noqa: B003
    try:
        yield reads
    finally:
        os.environ = environ  # noqa: B003 - putting the same object back, not clearing anything
        _active.remove(reads)


# Variables Kiln sets anew each run (its scratch folder for temporary files): no input of the user's data
PER_RUN = {"TMPDIR", "TEMP", "TMP"}


class _WatchedEnviron(MutableMapping[str, str]):
    """``os.environ`` noting the names read through it (``os.getenv`` reads it too): an environment variable that
    picks the data's file is an input of the call. Code that kept a reference to ``os.environ`` from before reads
    the real one, unseen."""

    def __init__(self, real: MutableMapping[str, str], seen: set[str]) -> None:
        self._real, self._seen = real, seen

    def _note(self, key: object) -> None:
        # another type is the real one's KeyError, not a name; a library reading its settings as it is imported
        # (torch reads hundreds) is the environment's doing, as for the files it opens
        if isinstance(key, str) and key not in PER_RUN and not _importing_a_library():
            self._seen.add(key)

    def _note_all(self) -> None:
        """The whole environment read (a copy, a loop over it): every name in it."""
        if not _importing_a_library():
            self._seen.update(k for k in self._real if isinstance(k, str) and k not in PER_RUN)

    def __getitem__(self, key: str) -> str:
        self._note(key)
        return self._real[key]

    def __contains__(self, key: object) -> bool:
        self._note(key)
        return key in self._real

    def __setitem__(self, key: str, value: str) -> None:
        self._real[key] = value

    def __delitem__(self, key: str) -> None:
        del self._real[key]

    def __iter__(self) -> Iterator[str]:
        self._note_all()
        return iter(self._real)

    def __len__(self) -> int:
        return len(self._real)

    def copy(self) -> dict[str, str]:
        self._note_all()
        return dict(self._real)

    def __getattr__(self, name: str) -> Any:  # os.environ's own methods (encodekey...) for code that calls them
        return getattr(self._real, name)


def installed_roots() -> list[Path]:
    """Where Python and installed packages live: files there are the environment's, not the user's."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, *site.getsitepackages(), site.getusersitepackages()}
    paths |= {p for p in sysconfig.get_paths().values()}
    return sorted({Path(p).resolve() for p in paths if p} - {Path("/")})


def user_files(reads: Reads, skip: list[Path]) -> tuple[list[Path], list[Path], list[Path]]:
    """The files, folders and missing files of ``reads`` that are the user's: not the environment's
    (:func:`installed_roots`), not the system's (``/proc``, ``/sys``, ``/dev`` but ``/dev/shm``), not under ``skip``;
    a module's compiled file stands for its source (one imported by name at run time is code no static reading of
    imports finds). Each as the path it was opened by, made absolute but not resolved: a link re-pointed at another
    file is then another file. Each sorted, each path once."""
    skip_roots = [*_roots(), *(p.resolve() for p in skip), Path("/proc"), Path("/sys")]

    def theirs(raw: str) -> Path | None:
        path = Path(raw)
        if "__pycache__" in path.parts:
            try:
                path = Path(source_from_cache(raw))
            except ValueError:
                return None
        real = path.resolve()
        if real.is_relative_to("/dev") and not real.is_relative_to("/dev/shm"):
            return None
        return None if any(real.is_relative_to(r) for r in skip_roots) else Path(os.path.abspath(path))

    kilns = {
        os.path.abspath(m.__file__)
        for n, m in list(sys.modules.items())
        if n.startswith("kiln.") and getattr(m, "__file__", None)
    }  # Kiln's own, wherever it is installed (an editable checkout)
    seen = {p for p in map(theirs, reads.files) if p is not None and str(p) not in kilns}
    files = {p for p in seen if p.is_file()}
    absent = {p for p in seen if not os.path.lexists(p)}
    folders = {p for p in map(theirs, reads.folders) if p is not None and p.is_dir()}
    return sorted(files), sorted(folders), sorted(absent)
