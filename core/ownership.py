"""Where Kiln may write: only places it made or owns, never through a link it did not create.

Every temporary file or folder Kiln makes is named after the path it stands for and the process that made it
(``.model.onnx.staging-<pid>-<hex>``), beside that path or inside the folder Kiln works in: a command killed
mid-write leaves such names behind, and the next command writing that path removes the ones whose process is
gone (:func:`clean_leftovers`). An output folder a command fills (``-o``) carries a record of what Kiln wrote
there (:data:`OWNED`); a file at an output path that Kiln did not write, or a symbolic link someone else put
there, is refused rather than replaced or followed.
"""

from __future__ import annotations

import errno
import getpass
import json
import logging
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Iterable, Iterator, Sized
from contextlib import contextmanager
from itertools import islice
from pathlib import Path

from kiln.core.errors import StorageError

OWNED = ".kiln-owned.json"  # in an output folder: name -> [size, mtime_ns] of every file Kiln wrote there
SCRATCH = ".kiln-tmp"  # a workdir's or output folder's own temporary space
CACHE = ".kiln-cache"  # beside a direct command's -o: its calibration and build caches
ENGINE_RECORD = "kiln-engine.json"  # an engine folder's own record of its files (``file_hashes``), by `kiln build`
# a file that says which command filled the folder whose .kiln-owned.json records it
MADE_BY = {"variants.json": "kiln precision", "loadtest.json": "kiln loadtest"}
CACHED = "Kiln's cache"
EXAMINED = 100  # files a refusal classifies at most (:func:`held`): it names only a few of each kind
# what a folder records of Kiln's files: its engine's (kiln-engine.json) and its .kiln-owned.json
Recorded = tuple[frozenset[str], dict[str, list[int]]]
log = logging.getLogger("kiln")
_LEFTOVER = re.compile(r"^\.(?P<final>.+)\.(?P<kind>staging|old|tmp|scratch)-(?P<pid>\d+)-[0-9a-f]{8}(\.tmp)?$")


def temp_name(final: Path, kind: str = "tmp") -> Path:
    """A fresh hidden name beside ``final`` that says whose it is: ``.<name>.<kind>-<pid>-<hex>`` (a file's ends
    in ``.tmp``)."""
    suffix = ".tmp" if kind == "tmp" else ""
    return final.parent / f".{final.name}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}{suffix}"


def final_of(temp: Path, kind: str = "staging") -> Path | None:
    """The path a :func:`temp_name` of ``kind`` stands in for (``.train.staging-<pid>-<hex>`` -> ``train``); None
    for a name that is no such temporary one."""
    found = _LEFTOVER.match(temp.name)
    return temp.parent / found["final"] if found and found["kind"] == kind else None


def is_leftover(name: str) -> bool:
    """Whether ``name`` is one of Kiln's temporary names (:func:`temp_name`), a killed command's or a live one's."""
    return _LEFTOVER.match(name) is not None


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists (one of another user's counts: its files are never taken)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_path(path: Path) -> None:
    """Remove a file, a link (never what it points to) or a folder tree."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def clean_leftovers(folder: Path, final_name: str | None = None, every: bool = False) -> None:
    """Remove the temporary files and folders of dead processes in ``folder`` (of ``final_name`` only, if given);
    ``every``: also those of live ones (the caller holds the folder's lock, so none is in use). An ``old`` folder
    whose final folder is missing is the last finished result, cut off between two renames: it is put back."""
    try:
        entries = list(folder.iterdir())
    except OSError:
        return
    for p in entries:
        m = _LEFTOVER.match(p.name)
        if not m or (final_name is not None and m["final"] != final_name):
            continue
        if not every and pid_alive(int(m["pid"])):
            continue
        final = folder / m["final"]
        if m["kind"] == "old" and not final.exists() and not final.is_symlink():
            os.replace(p, final)
        else:
            remove_path(p)


def refuse_link(path: Path, what: str) -> None:
    """A symbolic link where Kiln would write (``what``: "-o", "the workdir's lock") is never followed nor
    replaced: someone else put it there."""
    if path.is_symlink():
        raise StorageError(
            f"{what} {path} is a symbolic link (to {os.readlink(path)}); Kiln never writes through a link "
            "it did not create",
            hint=f"remove the link {path}, or give Kiln another path",
        )


def open_nofollow(path: Path, flags: int, mode: int = 0o666) -> int:
    """``os.open`` that refuses a symbolic link at ``path`` (``O_NOFOLLOW``) with a clear error."""
    try:
        return os.open(path, flags | getattr(os, "O_NOFOLLOW", 0), mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            refuse_link(path, "the path")
        raise


def _stat(path: Path) -> list[int]:
    st = path.lstat()
    return [st.st_size, st.st_mtime_ns]


def owned_files(folder: Path) -> dict[str, list[int]]:
    """What Kiln recorded writing into ``folder`` (relative path -> [size, mtime_ns]); empty without a record."""
    try:
        record = json.loads((folder / OWNED).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def claim_folder(folder: Path, what: str = "-o", names: Iterable[str] | None = None) -> None:
    """Allow writing into ``folder`` only where it is new, empty, or holds nothing but files Kiln recorded writing
    there, unchanged since (``names``: only these entries matter, e.g. the files a load test writes into a folder
    that may hold anything else). Leftovers of a killed command are removed first."""
    refuse_link(folder, what)
    if folder.exists() and not folder.is_dir():
        raise StorageError(f"{what} {folder} is a file, not a folder", hint=f"give a new or empty folder for {what}")
    if not folder.is_dir():
        return
    clean_leftovers(folder)
    owned = owned_files(folder)
    if names is None:
        paths = [p for p in folder.rglob("*") if (not p.is_dir() or p.is_symlink()) and p.name != OWNED]
    else:
        paths = [folder / n for n in names if (folder / n).exists() or (folder / n).is_symlink()]
    foreign = sorted(
        rel
        for p in paths
        for rel in [p.relative_to(folder).as_posix()]
        if p.is_symlink() or not p.is_file() or owned.get(rel) != _stat(p)
    )
    if foreign:
        raise StorageError(
            f"{what} {folder} already holds {held(folder, [folder / rel for rel in foreign])}; writing there would "
            "replace them",
            hint=f"move them away, or give {what} a new or empty folder (or one an earlier run of this command wrote)",
        )


def held(folder: Path, paths: Iterable[Path]) -> str:
    """What ``paths`` (files inside ``folder``) are, for a refusal to write over them: the files no Kiln command
    wrote, then other Kiln commands' output (:func:`kiln_output`), by whose it is and where that is recorded.
    Only the first :data:`EXAMINED` are classified (the message names a few of each kind), so a huge folder costs
    little: the rest are counted where ``paths`` is a list, else only said to be there."""
    records: dict[Path, Recorded] = {}
    foreign: list[str] = []
    kilns: dict[str, list[str]] = {}
    rest = iter(paths)
    for p in islice(rest, EXAMINED):
        whose = kiln_output(folder, p, records)
        if whose is None:
            foreign.append(p.relative_to(folder).as_posix())
        elif whose[1] not in kilns.setdefault(whose[0], []):
            kilns[whose[0]].append(whose[1])
    parts = [f"files Kiln did not write ({_listed(foreign)})"] if foreign else []
    if kilns:
        said = [f"{who} {'' if who == CACHED else 'recorded in '}{_listed(at, 3)}" for who, at in kilns.items()]
        parts.append(f"other Kiln commands' output ({'; '.join(said)})")
    left = len(paths) - EXAMINED if isinstance(paths, Sized) else int(next(rest, None) is not None)
    if left > 0:
        parts.append(f"{left} more files" if isinstance(paths, Sized) else "more files")
    return " and ".join(parts)


def _listed(items: list[str], first: int = 5) -> str:
    return ", ".join(items[:first]) + (f" and {len(items) - first} more" if len(items) > first else "")


def kiln_output(folder: Path, path: Path, records: dict[Path, Recorded] | None = None) -> tuple[str, str] | None:
    """Whose output ``path``, a file inside ``folder``, is where another Kiln command wrote it, and where that is
    recorded (relative to ``folder``): a file in Kiln's cache (:data:`CACHE`), one an engine's
    :data:`ENGINE_RECORD` lists, or one a ``.kiln-owned.json`` of its folder or a folder above it (up to
    ``folder``) records unchanged, or that record. None: no Kiln command wrote it, or it changed since (a link
    never counts). ``records``: what was already read, by folder (:func:`_recorded`), so that asking of many
    files reads each folder's records once."""
    rel = path.relative_to(folder)
    if path.is_symlink() or not path.is_file():
        return None
    if CACHE in rel.parts[:-1]:
        return CACHED, Path(*rel.parts[: rel.parts.index(CACHE) + 1]).as_posix()
    records = {} if records is None else records
    for d in [path.parent, *path.parent.parents][: len(rel.parts)]:  # from the file's folder up to ``folder``
        name, at = path.relative_to(d).as_posix(), d.relative_to(folder)
        if d not in records:
            records[d] = _recorded(d)
        engine, record = records[d]
        if name in engine:
            return "kiln build's output", (at / ENGINE_RECORD).as_posix()
        if record.get(name) == _stat(path) or (name == OWNED and record):  # a file it records, or the record
            command = next((c for marker, c in MADE_BY.items() if (d / marker).is_file()), "a Kiln command")
            return f"{command}'s output", (at / OWNED).as_posix()
    return None


def _recorded(folder: Path) -> Recorded:
    """What ``folder`` records of Kiln's files: its engine's (:func:`_engine_files`) and its ``.kiln-owned.json``."""
    return frozenset(_engine_files(folder)), owned_files(folder)


def _engine_files(folder: Path) -> list[str]:
    """The files of the engine in ``folder``: those its :data:`ENGINE_RECORD` lists, and the record itself; none
    without a readable one."""
    if not (folder / ENGINE_RECORD).is_file():
        return []
    try:
        listed = json.loads((folder / ENGINE_RECORD).read_text()).get("file_hashes")
    except (OSError, ValueError, AttributeError):
        return []
    return [*listed, ENGINE_RECORD] if isinstance(listed, dict) else []


def record_owned(folder: Path, names: Iterable[str] | None = None) -> None:
    """Record the files Kiln just wrote into ``folder`` (all of them, or ``names`` added to the record), for
    :func:`claim_folder`."""
    record = owned_files(folder) if names is not None else {}
    paths = [folder / n for n in names] if names is not None else [p for p in folder.rglob("*") if p.is_file()]
    record |= {p.relative_to(folder).as_posix(): _stat(p) for p in paths if p.name != OWNED and p.is_file()}
    tmp = temp_name(folder / OWNED, "tmp")
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
    os.replace(tmp, folder / OWNED)  # whole or not at all; a link at its path is replaced, not followed


@contextmanager
def output_file(path: Path, what: str = "-o") -> Iterator[Path]:
    """Write an output file (an ONNX model, with ``<name>.data`` beside it when its weights are external): yields a
    path in a staging folder beside ``path``; on success the files move into place and are recorded as Kiln's.
    A file already there that Kiln did not write, or a link, is refused before any work."""
    path = Path(path)
    names = [path.name, path.name + ".data"]
    refuse_link(path, what)
    path.parent.mkdir(parents=True, exist_ok=True)
    clean_leftovers(path.parent)
    owned = owned_files(path.parent)
    for name in names:
        p = path.parent / name
        if (p.exists() or p.is_symlink()) and (p.is_symlink() or not p.is_file() or owned.get(name) != _stat(p)):
            raise StorageError(
                f"{what} {p} already exists and Kiln did not write it; writing there would replace it",
                hint=f"move it away, or give {what} another path",
            )
    staging = temp_name(path, "staging")
    staging.mkdir()
    try:
        yield staging / path.name
        made = sorted(staging.iterdir(), key=lambda p: p.name == path.name)  # the weights first, the model last
        for f in made:
            os.replace(f, path.parent / f.name)
        stale = path.parent / names[1]
        if names[1] not in {f.name for f in made} and stale.is_file() and not stale.is_symlink():
            stale.unlink()  # the weights of the model replaced (claimed above: Kiln wrote them)
        record_owned(path.parent, [f.name for f in made])
    finally:
        shutil.rmtree(staging, ignore_errors=True)


# Where libraries keep caches and settings under HOME; pointed into the run's scratch when HOME is not usable.
HOME_CACHES = ("MPLCONFIGDIR", "XDG_CACHE_HOME", "XDG_CONFIG_HOME")
# What a library writes into the environment on first use, from the temporary folder in use then: Inductor notes
# its cache folder in TORCHINDUCTOR_CACHE_DIR and keeps to it for the rest of the process.
NOTED_BY_LIBRARIES = ("TORCHINDUCTOR_CACHE_DIR",)


def inductor_cache_dir() -> str:
    """Where torch's Inductor keeps its cache when nothing says otherwise: ``torchinductor_<user>`` in the system's
    temporary folder (torch's own rule, without importing torch for it)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def _inductor_paths_out_of(root: Path) -> None:
    """Inductor keeps paths it took from the temporary folder for the rest of the process: its precompiled headers'
    folder (from the folder in use when it was imported) with the headers built there, and its local cache file.
    Taken inside a scratch, they name removed files after it: the process's next AOTInductor build failed
    ("precompiled header: No such file") and the torch engine fell back to its compiled flavour. Pointed back at
    Inductor's own folder (the scratch is gone: the next run's compiles start cold, as the first did)."""
    import sys

    codecache = sys.modules.get("torch._inductor.codecache")
    if codecache is None:
        return
    headers = getattr(codecache, "_HEADER_DIR", None)
    if isinstance(headers, str) and Path(headers).is_relative_to(root):
        codecache._HEADER_DIR = os.path.join(inductor_cache_dir(), "precompiled_headers")
        codecache._HEADER_LOCK_DIR = os.path.join(codecache._HEADER_DIR, "locks")
        for cached in (getattr(codecache, "_precompile_header", None),):
            if hasattr(cached, "cache_clear"):
                cached.cache_clear()
    local = getattr(getattr(codecache, "CacheBase", None), "get_local_cache_path", None)
    if hasattr(local, "cache_clear"):
        local.cache_clear()  # computed again from TORCHINDUCTOR_CACHE_DIR, restored above


def home_usable() -> bool:
    """Whether HOME is set and names a folder this process can write: otherwise libraries' caches must go
    elsewhere (Kiln itself keeps nothing under HOME)."""
    home = os.environ.get("HOME")
    return bool(home) and os.path.isdir(home) and os.access(home, os.W_OK | os.X_OK)


@contextmanager
def scratch_root(folder: Path) -> Iterator[Path]:
    """Within this block every temporary file of this process (``tempfile``'s, so Kiln's, ONNX Runtime's and
    torch's) goes into ``folder/.kiln-tmp/.run.scratch-<pid>-<hex>``, removed when the block ends however it
    ends: inside the workdir or beside the -o path the user gave, not in a shared ``/tmp``. With HOME unset or
    unusable, libraries' caches go there too (Inductor's: unless TORCHINDUCTOR_CACHE_DIR names a folder). What
    libraries note meanwhile for the rest of the process is undone with the rest (:data:`NOTED_BY_LIBRARIES`,
    :func:`_inductor_paths_out_of`): it named the removed scratch after the run, where later compiles wrote into
    the workdir and AOTInductor builds failed. A folder that cannot be written keeps the system's temporary
    folder (said in the log). Yields the folder in use."""
    base = Path(folder).absolute() / SCRATCH  # TMPDIR for compilers that run from another folder
    made = [p for p in (base, *base.parents) if not p.exists()]  # removed again if the block leaves them empty
    try:
        refuse_link(base, "Kiln's temporary folder")
        base.mkdir(parents=True, exist_ok=True)
        clean_leftovers(base, "run")  # those of killed commands
        root = temp_name(base / "run", "scratch")
        root.mkdir()
    except OSError as exc:
        log.info("temporary files go to %s: cannot write %s (%s)", tempfile.gettempdir(), base, exc.strerror)
        yield Path(tempfile.gettempdir())
        return
    settings = {"TMPDIR": str(root)}  # for the processes Kiln starts too
    if not home_usable():  # libraries' caches (matplotlib's, XDG's) would go to / or to an odd place
        settings |= {k: str(root / k.lower()) for k in HOME_CACHES if k not in os.environ}
    previous, env = tempfile.tempdir, {k: os.environ.get(k) for k in (*settings, *NOTED_BY_LIBRARIES)}
    tempfile.tempdir = str(root)
    os.environ.update(settings)
    try:
        yield root
    finally:
        tempfile.tempdir = previous
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _inductor_paths_out_of(root)
        shutil.rmtree(root, ignore_errors=True)
        for empty in made or [base]:  # only when empty: another command's scratch, or what the block wrote, stays
            try:
                empty.rmdir()
            except OSError:
                break


@contextmanager
def scratch_dir(prefix: str) -> Iterator[Path]:
    """A temporary folder (under the current :func:`scratch_root`, else the system's), removed however the block
    ends, a failure included."""
    path = Path(tempfile.mkdtemp(prefix=f"{prefix}-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
