"""One exception family for everything a user can cause.

The CLI catches :class:`KilnError` and prints ``message`` plus ``hint`` with a non-zero exit code and no
traceback. Anything else escaping is a bug in Kiln and keeps its traceback.
"""

from __future__ import annotations

import difflib
import errno


class KilnError(Exception):
    """A problem the user can fix. ``hint`` says how."""

    exit_code = 2

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\n  fix: {self.hint}"


class Interrupted(KilnError):
    """Ctrl-C: exit 130, as a shell reports a command SIGINT stopped."""

    exit_code = 130


class ConfigError(KilnError):
    """Bad config key, type or value."""


class InputFileError(KilnError):
    """A file the user named is missing, unreadable or corrupt."""


class InputError(KilnError):
    """Arrays handed to an engine are not what it takes (names, dtypes, ranks, fixed sizes)."""


class ModelError(KilnError):
    """The model cannot be built, exported or handled (unsupported op, shape mismatch...)."""


class BackendUnavailable(KilnError):
    """A backend library (tensorrt, onnxruntime-gpu...) is not installed or cannot run here."""


class BuildError(KilnError):
    """An engine build failed."""


class TrainingError(KilnError):
    """Training diverged (NaN/Inf loss) or cannot start."""


class WorkdirBusy(KilnError):
    """Another Kiln run holds the workdir."""


class GateFailure(KilnError):
    """A validation gate failed: the engine is not as accurate or fast as the config demands."""

    exit_code = 3


class StorageError(KilnError):
    """The disk refused a read or write: full, read-only, no permission, a path of the wrong kind."""


def storage_error(exc: OSError, doing: str = "") -> StorageError:
    """An OS error as one clear message and a fix, by errno (a traceback tells a user nothing they can act on).
    ``doing``: what Kiln was at (``"writing the report"``), when the error's own path does not say it."""
    what = (f" while {doing}" if doing else "") + (f": {exc.filename}" if exc.filename else "")
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):  # "disk full while writing" + the file, or what
        return disk_full_error(exc.filename or doing.removeprefix("writing "))
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        kind = "read-only file system" if exc.errno == errno.EROFS else "permission denied"
        return StorageError(
            f"{kind}{what}", hint="choose a folder you can write to (--workdir / -o), or fix its permissions"
        )
    if exc.errno in (errno.ENOTDIR, errno.EISDIR, errno.EEXIST):
        return StorageError(
            f"{exc.strerror}{what}",
            hint="a file stands where a folder is expected (or the reverse): move it or pick another path",
        )
    if exc.errno == errno.ENOENT:
        return StorageError(
            f"no such file or folder{what}", hint="check the path; it may have been removed while Kiln ran"
        )
    return StorageError(
        f"{exc.strerror or type(exc).__name__}{what}", hint="check the disk and the path, then run again"
    )


# How libraries that wrap the OS error say it: torch's zip writer, Rust's (safetensors) error kinds, the C library.
DISK_FULL_TEXT = ("no space left on device", "disk quota exceeded", "storagefull", "os error 28", "errno 28")
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def disk_full_error(where: object) -> StorageError:
    """The one message for a full disk (or quota), whichever stage or library was writing ``where``."""
    return StorageError(
        f"disk full while writing {where} (no space left on the device)",
        hint="free disk space (or point --workdir / -o at a larger disk) and run again; "
        "finished stages are kept and the run resumes",
    )


def disk_full(exc: BaseException, where: object) -> StorageError | None:
    """:func:`disk_full_error` if a full disk is what ``exc`` comes down to, else None. Libraries wrap the OS error
    (torch.save's RuntimeError, ONNX Runtime's Fail) and Kiln's own errors quote them, so the chain
    (``__cause__``/``__context__``, kept even under ``raise ... from None``) and the messages are both read:
    the cause the user acts on is the disk, not "export failed"."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS:
            return disk_full_error(where or e.filename)
        text = (e.message if isinstance(e, KilnError) else str(e)).lower()
        if any(t in text for t in DISK_FULL_TEXT):
            return disk_full_error(where)
        todo += [e.__cause__, e.__context__]
    return None


def refuse_unknown_names(wrong: list[tuple[str, str, str, list[str]]]) -> None:
    """One :class:`ConfigError` for every ``(setting, kind, name, known)`` whose ``name`` (a node, an op type) the
    graph does not have, with the closest of its ``known`` ones: a typo in a list of names to keep in float would
    otherwise keep nothing, silently. Nothing where ``wrong`` is empty."""
    if not wrong:
        return
    raise ConfigError(
        "; ".join(f"{key} names {kind} '{name}', which the graph does not have" for key, kind, name, _ in wrong),
        hint="use names the graph has; closest: "
        + "; ".join(
            f"'{name}' -> {', '.join(difflib.get_close_matches(name, known, 3, 0))}" for *_, name, known in wrong
        ),
    )
