"""One exception family for everything a user can cause.

The CLI catches :class:`KilnError` and prints ``message`` plus ``hint`` with a non-zero exit code and no
traceback. Anything else escaping is a bug in Kiln and keeps its traceback.
"""
from __future__ import annotations


class KilnError(Exception):
    """A problem the user can fix. ``hint`` says how."""

    exit_code = 2

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\n  fix: {self.hint}"


class ConfigError(KilnError):
    """Bad config key, type or value."""


class InputFileError(KilnError):
    """A file the user named is missing, unreadable or corrupt."""


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
