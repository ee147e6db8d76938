"""Content hashes of user-supplied data that neither the config nor the code pins down.

A user's data module or calibration reader (``package.module:function``) may read files, and
``model.checkpoint`` names one: the cache key covers the config (paths) and the code, not what the files hold.
Stages that read such data name a fingerprint here (``Stage.data``) and the runner adds its value to their cache
key, computed once per run.
Built-in datasets are pinned by Kiln's code and config, so they need none (and cost nothing).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.core.artifacts import hash_file, hash_json, hash_source, keep_json
from kiln.core.errors import InputFileError
from kiln.core.file_reads import recording, user_files
from kiln.pipeline.config import KilnConfig
from kiln.pipeline.user_code import code_version

if TYPE_CHECKING:
    import numpy as np

    from kiln.core.data import DatasetSplits

log = logging.getLogger("kiln")


def _is_import_path(name: str | None) -> bool:
    return bool(name) and ":" in name


def dataset_fingerprint(
    config: KilnConfig,
    workdir: Path | None = None,
    load: Callable[[], DatasetSplits] | None = None,
    timings: dict[str, float] | None = None,
) -> str | None:
    """Hash of every tensor of a user dataset (loaded the way stages load it), or None for a built-in one. With
    ``data.skip_unchanged``, kept in the workdir's cache (:func:`_kept_hash`). ``load``: the run's dataset (by
    default, loaded here); ``timings``: given, gets how long the call to hash took (``"data"``: seconds), and the
    caller says whether it was slow (:func:`slow_call_hint`)."""
    if not _is_import_path(config.data.name):
        return None
    if config.data.skip_unchanged and workdir is not None:
        parts = {
            "data": config.data.model_dump(mode="json", exclude={"depends_on"}),
            "model": [config.model.name, config.model.onnx],
            "signature": config.signature.model_dump(mode="json"),
            "seed": config.seed,
            "code": code_version(config.data.name.partition(":")[0]),
            "kiln": hash_source("kiln.models.model_io", "kiln.models.registry", "kiln.core.data"),
        }
        return _kept_hash(workdir, "data", parts, config.data.depends_on, lambda: _dataset_hash(config, load))
    return _timed("data function", lambda: _dataset_hash(config, load), "data", timings)


def _dataset_hash(config: KilnConfig, load: Callable[[], DatasetSplits] | None = None) -> str:
    from kiln.models.model_io import dataset_for

    return splits_hash(
        load() if load is not None else dataset_for(config.model, config.data, config.signature, config.seed)
    )


def splits_hash(d: DatasetSplits) -> str:
    """Hash of every tensor of a dataset: what the stages that read it are keyed by (``user_data.dataset``)."""
    from kiln.calibration.data import hash_batches  # torch and numpy: only for a user dataset
    from kiln.core.data import tensors

    parts = [d.train_x, d.train_y, d.val_x, d.val_y]
    return hash_batches([_array(t) for p in parts if p is not None for t in tensors(p)])


SLOW_CALL_S = 1.0  # user code slower than this to call only for its hash is worth a hint
_said_slow: set[str] = set()


def _timed(what: str, call: Callable[[], str], section: str, timings: dict[str, float] | None = None) -> str:
    """``call()``, with a hint the first time in a process it takes over :data:`SLOW_CALL_S`; ``timings``: given,
    gets how long it took under ``section`` instead, for the caller to say."""
    started = time.perf_counter()
    value = call()
    took = time.perf_counter() - started
    if timings is not None:
        timings[section] = took
    elif took >= SLOW_CALL_S and section not in _said_slow:
        _said_slow.add(section)
        log.info("%s", slow_call_hint(section, what, took))
    return value


def slow_call_hint(section: str, what: str, took: float, share: str = "") -> str:
    """The hint that user code called only for its hash was slow, naming ``<section>.skip_unchanged`` and what it
    relies on. ``share``: what part of the run the call was, said after its time."""
    return (
        f"{section}: calling the {what} to hash what it returns (its module's imports included: torch, a"
        f" model library) took {took:.1f} s{share}; with "
        f"{section}.skip_unchanged a run skips the call while what it read is unchanged (docs/configuration.md, "
        "'A data function slow to call')"
    )


KEPT_FILE = "data-hashes.json"  # in the workdir's cache folder: what user code read, and the hash of what it returned
KEPT_HASHES = 8


def _kept_hash(
    workdir: Path, section: str, parts: dict[str, Any], depends_on: list[str], call: Callable[[], str]
) -> str:
    """The hash ``call()`` returns for the user code of ``section`` (its data function, its calibration reader),
    kept in the workdir's cache under a stamp of what goes into the call (``parts``: its config and code; the paths
    of ``<section>.depends_on``) with the stamps of what the call was seen reading (:mod:`kiln.core.file_reads`:
    files, folder listings, files it looked for and did not find, environment variables) and of the files
    ``depends_on`` names. Called anew when any of them differs; on every run when the call reached past this
    machine's files (the run says why); and next run too when a file it read changed while it ran."""
    path = workdir / "cache" / KEPT_FILE
    kept = _read_kept(path)
    for p in depends_on:
        if not Path(p).exists():
            raise InputFileError(
                f"{section}.depends_on names {p}, which does not exist",
                hint=f"fix the path or remove it from {section}.depends_on",
            )
    stamp = hash_json({**parts, "section": section, "depends_on": depends_on, "cwd": str(Path.cwd())})
    entry = kept.get(stamp)
    if isinstance(entry, dict) and isinstance(entry.get("read"), dict) and _all_unchanged(entry["read"], workdir):
        settled = _settled(entry["read"])
        if settled != entry["read"]:  # stamps with a digest that need none now: not read again on every run
            keep_json(path, kept | {stamp: {**entry, "read": settled}})
        return entry["hash"]
    started = time.time_ns()
    with recording() as reads:
        value = call()
    if reads.reached_out:
        log.warning(
            "%s: %s.skip_unchanged is set, but its code reached past this machine's files or into another "
            "process, whose reads are not seen (%s): it is called on every run to see what it returns",
            section,
            section,
            reads.reached_out,
        )
        return value
    files, folders, absent = user_files(reads, skip=[workdir, *map(Path, depends_on)])
    read = {str(f): _data_stamp(f) for f in files} | {str(d) + "/": _listing(d) for d in folders}
    read |= {str(a): ABSENT for a in absent} | {
        ENV + k: _env(k) for k in sorted(k for k in reads.environ if isinstance(k, str))
    }
    read |= _declared(depends_on, workdir)
    if any(_changed_since(Path(n), started) for n, v in read.items() if _is_file_stamp(n, v)):
        return value  # a file it read changed while it ran: what it returned may be from before
    kept = {k: v for k, v in kept.items() if k != stamp}
    kept = dict(list(kept.items())[-(KEPT_HASHES - 1) :]) | {stamp: {"hash": value, "read": read}}
    keep_json(path, kept)
    return value


ABSENT = "absent"  # a file the call looked for and did not find: its appearing is a change
ENV = "$"  # an environment variable the call read, as ``$NAME``: its value, or None


def _env(name: str) -> str | None:
    return os.environ.get(name)


def _is_file_stamp(name: str, stamp: str | None) -> bool:
    return not name.endswith("/") and not name.endswith("/**") and not name.startswith(ENV) and stamp != ABSENT


def _changed_since(path: Path, started_ns: int) -> bool:
    try:
        st = path.stat()
    except OSError:
        return True
    return max(st.st_mtime_ns, st.st_ctime_ns) >= started_ns


def _declared(depends_on: list[str], workdir: Path) -> dict[str, str]:
    """Stamps of the files ``depends_on`` names and of every file under the folders it names (a folder holding the
    workdir without it: the run itself writes there), with each folder's list of files as ``<folder>/**``."""
    out = {}
    for p in depends_on:
        path = Path(os.path.abspath(p))
        if path.is_file():
            out[str(path)] = _data_stamp(path)
            continue
        files = _tree_files(path, workdir)
        out |= {str(f): _data_stamp(f) for f in files}
        out[f"{path}/**"] = hash_json([f.relative_to(path).as_posix() for f in files])
    return out


def _tree_files(folder: Path, workdir: Path) -> list[Path]:
    """Every file under ``folder``, but those under ``workdir``."""
    work = workdir.resolve()
    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if (Path(root) / d).resolve() != work)
        found += [Path(root) / name for name in sorted(files) if (Path(root) / name).is_file()]
    return found


def _all_unchanged(read: dict[str, str | None], workdir: Path) -> bool:
    """Whether every entry of ``read`` still has the stamp kept for it: a file's (:func:`_still`), a folder's
    listing (``/``), a folder's files (``/**``), an absent file still absent, an environment variable's value."""
    for name, kept in read.items():
        try:
            if name.startswith(ENV):
                now: Any = _env(name[len(ENV) :])
            elif name.endswith("/**"):
                folder = Path(name[:-3])
                now = hash_json([f.relative_to(folder).as_posix() for f in _tree_files(folder, workdir)])
            elif name.endswith("/"):
                now = _listing(Path(name[:-1]))
            elif kept == ABSENT:
                now = ABSENT if not os.path.lexists(name) else "present"
            else:
                now = kept if _still(Path(name), kept) else None
        except OSError:  # gone
            return False
        if now != kept:
            return False
    return True


def _listing(folder: Path) -> str:
    return hash_json(sorted(os.listdir(folder)))


RACY_NS = 2 * 10**9  # a file modified this close to its stamp may be rewritten within one tick of the file clock


def _data_stamp(path: Path) -> str:
    """A file's size, mtime, inode and ctime, the way build tools know a file unchanged (the ctime no program can
    set: a reproducible archive unpacked over it keeps the size and mtime); for a file modified in the last
    :data:`RACY_NS` also its content's hash (git's "racily clean" case: rewritten within the file clock's tick at the
    same size, it keeps its times)."""
    st = path.stat()
    stamp = f"{st.st_size}:{st.st_mtime_ns}:{st.st_ino}:{st.st_ctime_ns}"
    recent = max(st.st_mtime_ns, st.st_ctime_ns) >= time.time_ns() - RACY_NS
    return stamp + ":" + hash_file(path) if recent else stamp


def _settled(read: dict[str, str | None]) -> dict[str, str | None]:
    """``read`` with each file stamp that carries a digest but whose file is now older than :data:`RACY_NS` (and
    unchanged: checked by the caller) by its stat alone, as git refreshes its index."""
    out = {}
    for name, kept in read.items():
        parts = kept.split(":") if isinstance(kept, str) and _is_file_stamp(name, kept) else []
        old = len(parts) == 5 and max(int(parts[1]), int(parts[3])) < time.time_ns() - RACY_NS
        out[name] = ":".join(parts[:4]) if old else kept
    return out


def _still(path: Path, kept: str) -> bool:
    """Whether the file has the stamp :func:`_data_stamp` gave it (its content too, where that was kept)."""
    st = path.stat()
    size, mtime, ino, ctime, *digest = kept.split(":")
    now = (str(st.st_size), str(st.st_mtime_ns), str(st.st_ino), str(st.st_ctime_ns))
    if now != (size, mtime, ino, ctime):
        return False
    return not digest or hash_file(path) == digest[0]


def _read_kept(path: Path) -> dict[str, Any]:
    try:
        kept = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    return kept if isinstance(kept, dict) else {}


def _array(t: object) -> np.ndarray:
    """Any tensor or array as numpy, for hashing only: bytes are what count (bfloat16 has no numpy type, a CUDA
    or grad-tracking tensor no direct view), and a wrong type is left to the stage's own clear check."""
    import numpy as np
    import torch

    if isinstance(t, torch.Tensor):
        t = t.detach().cpu()
        return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()
    return np.asarray(t)


def checkpoint_fingerprint(config: KilnConfig) -> str | None:
    """Hash of the ``model.checkpoint`` file the train stage starts from, if any."""
    if not config.model.checkpoint:
        return None
    path = Path(config.model.checkpoint)
    if not path.is_file():
        raise InputFileError(f"model.checkpoint not found: {path}", hint="fix the path or remove model.checkpoint")
    return hash_file(path)


LARGE_FILE = 256 * 2**20  # above this, a file named in model.params is known by its size and mtime, not hashed


def model_files_fingerprint(config: KilnConfig, workdir: Path | None = None) -> str | None:
    """A stamp of the files and folders ``model.params`` names (a ``config.json``, a ``from_pretrained`` folder):
    the factory builds the model from them, so editing one must retrain as editing its code does. A value counts
    when it is a path that exists, relative to where Kiln runs (as the factory opens it); the working folder, the
    folders above it, and anything holding or inside the ``workdir`` do not. A file is hashed (up to
    :data:`LARGE_FILE`); a folder's files, which may be many and large, are known by their sizes and mtimes."""
    here = Path.cwd().resolve()
    work = workdir.resolve() if workdir is not None else None
    found = {}
    for value in _strings(config.model.params):
        path = Path(value)
        if not value or not path.exists():
            continue
        real = path.resolve()
        if here.is_relative_to(real) or (work is not None and (work.is_relative_to(real) or real.is_relative_to(work))):
            continue
        if path.is_file():
            found[value] = _file_stamp(path)
        else:
            found[value] = {f.relative_to(path).as_posix(): _stat(f) for f in sorted(path.rglob("*")) if f.is_file()}
    return hash_json(found) if found else None


def _strings(value: object) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _strings(v)]
    return []


def _stat(path: Path) -> str:
    st = path.stat()
    return f"{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"


def _file_stamp(path: Path) -> str:
    return hash_file(path) if path.stat().st_size <= LARGE_FILE else _stat(path)


def onnx_fingerprint(config: KilnConfig) -> str | None:
    """Hash of the ``model.onnx`` file a run starts from and of the external-data files beside it, if any: the
    dynamo exporter keeps the weights in ``model.onnx.data``, which can change while the graph stays."""
    if not config.model.onnx:
        return None
    from kiln.core.onnx_io import onnx_files

    path = Path(config.model.onnx)
    if not path.is_file():
        raise InputFileError(f"model.onnx not found: {path}", hint="fix the path or remove model.onnx")
    return hash_json({f.relative_to(path.parent).as_posix(): hash_file(f) for f in onnx_files(path)})


def calibration_fingerprint(config: KilnConfig, workdir: Path | None = None) -> str | None:
    """Hash of the batches a user calibration reader yields (what calibration would use), or None when there is
    no reader or the precision stage will not calibrate. With ``calibration.skip_unchanged``, kept in the workdir's
    cache (:func:`_kept_hash`)."""
    ccfg, pcfg = config.calibration, config.precision
    needs_data = "int8" in pcfg.variants or ("fp16" in pcfg.variants and pcfg.fp16.range_check)
    if not (ccfg.reader and needs_data):
        return None

    def call() -> str:
        from kiln.calibration.data import hash_batches, read_reader

        return hash_batches(read_reader(ccfg))

    if ccfg.skip_unchanged and workdir is not None and _is_import_path(ccfg.reader):
        parts = {
            "calibration": ccfg.model_dump(mode="json", exclude={"depends_on"}),
            "code": code_version(ccfg.reader.partition(":")[0]),
            "kiln": hash_source("kiln.calibration.data", "kiln.models.registry"),
        }
        return _kept_hash(workdir, "calibration", parts, ccfg.depends_on, call)
    return _timed("calibration reader", call, "calibration")


# name -> (config, workdir) -> fingerprint
FINGERPRINTS: dict[str, Callable[[KilnConfig, Path], str | None]] = {
    "dataset": dataset_fingerprint,
    "checkpoint": lambda config, _: checkpoint_fingerprint(config),
    "model_files": model_files_fingerprint,
    "onnx": lambda config, _: onnx_fingerprint(config),
    "calibration": calibration_fingerprint,
}
