"""Content hashing and atomic writes: the two primitives the cache and every stage rely on.

Hashes are of content, never of paths or names (two models at one path must not share a cache entry).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pydantic_core import to_jsonable_python

from kiln.core.errors import storage_error
from kiln.core.ownership import claim_folder, clean_leftovers, record_owned, remove_path, temp_name

CHUNK = 1 << 20


def hash_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def hash_json(obj: Any) -> str:
    return hash_bytes(json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode())


def hash_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def hash_tree(root: Path, exclude: tuple[str, ...] = ()) -> dict[str, str]:
    """Relative path -> sha256 of every file under ``root`` (sorted; ``exclude`` names skipped)."""
    return {
        p.relative_to(root).as_posix(): hash_file(p)
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name not in exclude
    }


def hash_source(*modules: str) -> str:
    """Hash of the source files of the named modules (packages: every .py under them): the code version. The files
    are found without running the modules (:func:`importlib.util.find_spec` runs only their parent packages)."""
    files: list[Path] = []
    for name in modules:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            raise ModuleNotFoundError(f"no source for module {name}")
        f = Path(spec.origin)
        files += sorted(f.parent.rglob("*.py")) if f.name == "__init__.py" else [f]
    return hash_json({p.name + str(i): hash_file(p) for i, p in enumerate(files)})


def ensure_writable(folder: Path, what: str) -> None:
    """Make ``folder`` (and its parents) and prove a file can be written there, before any work: a read-only
    or full disk is then reported against the folder the user named (``what``: "-o", "--workdir"), not
    minutes later against an internal temporary name."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".kiln-write-test-{uuid.uuid4().hex[:8]}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:  # named by the folder the user gave, not by the probe file
        raise storage_error(OSError(exc.errno, exc.strerror), f"writing into {what} {folder}") from None


def write_text_atomic(path: Path, text: str) -> None:
    write_bytes_atomic(path, text.encode())


def json_text(obj: Any, sort_keys: bool = True) -> str:
    """``obj`` as strict JSON, indented: each NaN or infinity as null, as pydantic writes the records
    (``validation.json``), since the bare ``NaN``/``Infinity`` tokens Python writes are no JSON other readers
    parse; what JSON has no type for (a path, a numpy scalar) as its text."""
    plain = to_jsonable_python(obj, inf_nan_mode="null", fallback=str)
    return json.dumps(plain, indent=2, sort_keys=sort_keys, allow_nan=False)


def write_json_atomic(path: Path, obj: Any, sort_keys: bool = True) -> None:
    write_text_atomic(path, json_text(obj, sort_keys) + "\n")


def keep_json(path: Path, obj: Any) -> bool:
    """``obj`` written to ``path`` in a cache folder, if it can be: never through a cache folder planted as a link
    (the stages that use it refuse it), and a read-only workdir is no error (what was kept is worked out again next
    time). Whether it was written."""
    if path.parent.is_symlink():
        return False
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, obj)
    except OSError:
        return False
    return True


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write to a temporary file in the same folder, fsync, then rename over ``path``: never a torn file. A link at
    ``path`` is replaced, never written through."""
    path.parent.mkdir(parents=True, exist_ok=True)
    clean_leftovers(path.parent, path.name)  # a killed writer's temporary file of this path
    tmp = temp_name(path, "tmp")
    # Created like open() creates files (0666 less the umask, applied by the kernel), not mkstemp's 0600: an
    # engine or model a serving process running as another user (e.g. Triton's) must read.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield an empty staging folder beside ``final``; on success it replaces ``final`` in one rename.

    On failure the staging folder is removed and whatever was at ``final`` before stays untouched.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    clean_leftovers(final.parent, final.name)  # what a killed run of this command left of ``final``
    staging = temp_name(final, "staging")
    staging.mkdir()
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    old = None
    if final.exists() or final.is_symlink():
        old = temp_name(final, "old")
        os.replace(final, old)
    os.replace(staging, final)
    if old is not None:
        remove_path(old)  # a link someone put there goes, never what it points to


def clean_stale_staging(root: Path) -> None:
    """Remove staging/old folders left by an interrupted run.

    An ``.old`` folder whose final folder is missing was cut off between :func:`atomic_dir`'s two renames:
    it is the last finished result, so it is put back rather than deleted.
    """
    if not root.is_dir():
        return
    clean_leftovers(root, every=True)  # the caller holds the workdir's lock: no temporary file here is in use
    for p in root.glob(".*.staging-*"):
        shutil.rmtree(p, ignore_errors=True)
    for p in root.glob(".*.old-*"):
        final = root / p.name[1:].rsplit(".old-", 1)[0]
        if final.exists():
            shutil.rmtree(p, ignore_errors=True)
        else:
            os.replace(p, final)


@contextmanager
def output_folder(folder: Path, what: str = "-o") -> Iterator[Path]:
    """Fill an output folder: yields a staging folder beside it that replaces ``folder`` whole on success, with a
    record of every file in it. A folder holding files Kiln did not write, or a link, is refused first."""
    folder = Path(folder)
    claim_folder(folder, what)
    with atomic_dir(folder) as staging:
        yield staging
        record_owned(staging)


MANIFEST = "manifest.json"


def read_manifest(stage_dir: Path) -> dict[str, Any] | None:
    """The stage's manifest, or None when it is missing, unreadable or not the shape Kiln writes (a damaged
    manifest means the stage is redone, never trusted)."""
    try:
        m = json.loads((stage_dir / MANIFEST).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    ok = (
        isinstance(m, dict)
        and isinstance(m.get("key"), str)
        and isinstance(m.get("outputs"), dict)
        and isinstance(m.get("sizes", {}), dict)
        and isinstance(m.get("key_parts", {}), dict)
        and isinstance(m.get("summary", {}), dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in m["outputs"].items())
    )
    return m if ok else None
