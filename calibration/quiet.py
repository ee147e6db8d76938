"""ONNX Runtime's quantizers and calibrators kept off the user's console: they log through the root logger (a
module-level ``logging.warning``, once per tensor) and warn through numpy, in their own format. What they say goes
to Kiln's debug log once per distinct line (``-vv`` shows it); what names tensors left in float is summed up in one
info line."""

from __future__ import annotations

import logging
import re
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger("kiln.calibration")

# the libraries' loggers a quantizer speaks through besides the root one (their handlers are swapped for the block)
ORT_LOGGERS = ("onnxruntime", "onnxconverter_common")
# ORT's quantizer on a tensor shape inference left untyped: it is not quantized (its node reads it in float)
UNTYPED = re.compile(r"failed to infer the type of tensor: (\S+?)\.? Skip")


class _Said(logging.Handler):
    """The libraries' records of the block, counted by message; Kiln's own records passed to ``handlers`` (the
    root logger's own, where Kiln's records propagate to it), as the root logger would."""

    def __init__(self, handlers: list[logging.Handler]) -> None:
        super().__init__()
        self.handlers = handlers
        self.said: Counter[str] = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith("kiln"):
            for h in self.handlers:
                if record.levelno >= h.level:
                    h.handle(record)
            return
        self.said[f"{record.name}: {record.getMessage()}"] += 1


@contextmanager
def ort_said_to_debug(what: str) -> Iterator[None]:
    """The block's library log records and Python warnings into Kiln's debug log, each distinct one once with its
    count (``what``: the call, for the log lines); the tensors ORT's quantizer could not type in one info line.
    The handlers and propagation of the root logger and :data:`ORT_LOGGERS` are restored after the block. It is
    process-wide while it runs (the loggers' handlers, Python's warnings filters): called from the main thread,
    around work no other thread logs during."""
    root = logging.getLogger()
    loggers = [root, *(logging.getLogger(n) for n in ORT_LOGGERS)]
    saved = [(q.handlers, q.propagate) for q in loggers]
    said = _Said(list(root.handlers))
    for q in loggers:
        q.handlers = [said]
        q.propagate = q is root
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        for q, (handlers, propagate) in zip(loggers, saved):
            q.handlers, q.propagate = handlers, propagate
        said.said.update(f"{w.category.__name__}: {w.message}" for w in caught)
        _log_said(what, said.said)


def _log_said(what: str, said: Counter[str]) -> None:
    """Each line once at debug level, with how often it was said; the untyped tensors in one info line."""
    for line, times in said.items():
        log.debug("%s: %s%s", what, line, f" ({times} times)" if times > 1 else "")
    untyped = sorted({m.group(1) for line in said for m in [UNTYPED.search(line)] if m})
    if untyped:
        more = f" and {len(untyped) - 4} more" if len(untyped) > 4 else ""
        log.info(
            "%s: ONNX Runtime's quantizer found no type for %d tensors (%s%s) after shape inference; they are not "
            "quantized (their nodes read them in float)",
            what,
            len(untyped),
            ", ".join(untyped[:4]),
            more,
        )
