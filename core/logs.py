"""Log filters shared by the Python API and the CLI: a stage's warning said once per run, and a block that leaves
the process's root logger as it found it."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

# The pipeline's stages, one logger each (their child loggers too): their warnings are said once per run.
ONCE_LOGGERS = tuple(
    f"kiln.{s}" for s in ("train", "export", "optimize", "precision", "calibration", "build", "validate")
)


class SaidOnce(logging.Filter):
    """Drop a stage's warning already said word for word in this run: a run reads the held-out rows in the
    precision stage (for the fallback) and again in validate, and a warning about the data or the model (one class
    on top everywhere, a metric of 0) would print once per stage. Other loggers' warnings (the server's, said per
    request or per client) are kept."""

    def __init__(self) -> None:
        super().__init__()
        self.said: set[tuple[str, str]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING or not record.name.startswith(ONCE_LOGGERS):
            return True
        key = (record.name, record.getMessage())
        if key in self.said:
            return False
        self.said.add(key)
        return True


def _stage_loggers() -> list[logging.Logger]:
    """The stage loggers and those of their children that exist now (a logger's filter sees only its own records,
    not those its children pass up)."""
    names = set(ONCE_LOGGERS) | {
        n for n in logging.Logger.manager.loggerDict if n.startswith(tuple(f"{o}." for o in ONCE_LOGGERS))
    }
    return [logging.getLogger(n) for n in sorted(names)]


@contextmanager
def warnings_said_once() -> Iterator[SaidOnce]:
    """A fresh :class:`SaidOnce` on the stage loggers for the block: every handler (the CLI's, a notebook's,
    Python's last-resort one) sees a repeated stage warning once, and the next run says it again."""
    said = SaidOnce()
    loggers = _stage_loggers()
    for logger in loggers:
        logger.addFilter(said)
    try:
        yield said
    finally:
        for logger in loggers:
            logger.removeFilter(said)


@contextmanager
def root_handlers_kept() -> Iterator[None]:
    """Restore the root logger's handlers after the block: a library's module-level ``logging.warning()`` (ONNX
    Runtime's quantizer has one) runs ``logging.basicConfig``, whose handler would print every library's warnings
    in the user's process from then on, in another format."""
    root = logging.getLogger()
    kept = list(root.handlers)
    try:
        yield
    finally:
        root.handlers[:] = kept
