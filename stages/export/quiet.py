"""The exporters kept quiet: their progress chatter, the graph torch.export prints when it fails and the
TorchScript exporter's C++ log go to the debug log (which --verbose shows), not the user's console. Shared by the
export and the probes that run torch.export again to find where a size was pinned."""

from __future__ import annotations

import io
import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext, redirect_stderr, redirect_stdout

log = logging.getLogger("kiln.export")
SHAPES_LOG = "torch.fx.experimental.symbolic_shapes"
# torch's loggers an export speaks through (with those under them): torch gives them handlers of their own that hold
# the terminal's stderr, so what they say passes redirect_stderr; tracing, guards and the exporters
TORCH_LOGS = ("torch.onnx", SHAPES_LOG, "torch._dynamo", "torch._guards", "torch.export", "torch._export")
# those whose progress chatter below ERROR costs time to make (a stack summary per guard)
_CHATTY = ("torch.onnx", SHAPES_LOG)


@contextmanager
def quiet_torch() -> Iterator[None]:
    """The exporter prints progress chatter and warns about optional torchvision ops, and torch.export prints the
    graph it failed on to stderr (twice), logs the symbol it could not place and, where a guard fails (axes one
    name ties that differ), a traceback at ERROR: keep the user's console clean, the failure's own message says why
    (what was said goes to the debug log, which --verbose shows)."""
    said = io.StringIO()
    try:
        with (
            warnings.catch_warnings(),
            redirect_stdout(said),
            redirect_stderr(said),
            _no_torchscript_log(),
            _torch_logs_to_debug(),
        ):
            warnings.simplefilter("ignore")
            yield
    finally:
        if said.getvalue().strip():  # what the exporter, or the model's own prints, said meanwhile: --verbose
            log.debug("while exporting:\n%s", said.getvalue())


class _ToDebug(logging.Handler):
    """A record of torch's, traceback included, into Kiln's debug log."""

    def emit(self, record: logging.LogRecord) -> None:
        log.debug("%s: %s", record.name, self.format(record))


@contextmanager
def _torch_logs_to_debug() -> Iterator[None]:
    """The records of :data:`TORCH_LOGS` and of the loggers under them that torch gave handlers go to Kiln's debug
    log alone, those of :data:`_CHATTY` from ERROR up; each logger's level, handlers and propagation are restored."""
    known = logging.Logger.manager.loggerDict
    under = [n for n in known if any(n.startswith(p + ".") for p in TORCH_LOGS) and getattr(known[n], "handlers", [])]
    loggers = [logging.getLogger(n) for n in (*TORCH_LOGS, *under)]
    saved = [(q.level, q.propagate, q.handlers) for q in loggers]
    to_debug = _ToDebug()
    for q in loggers:
        q.handlers, q.propagate = [to_debug], False
        if q.name in _CHATTY:
            q.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for q, (level, propagate, handlers) in zip(loggers, saved):
            q.setLevel(level)
            q.propagate, q.handlers = propagate, handlers


@contextmanager
def _no_torchscript_log() -> Iterator[None]:
    """The TorchScript exporter switches its C++ log on whatever ``verbose`` says (its check reads the function
    ``_jit_is_onnx_log_enabled`` instead of calling it) and, when it fails, writes the whole TorchScript graph to
    stderr ahead of Kiln's error; its switch is a no-op for the call. Without that module (another torch): as is."""
    try:
        from torch.onnx._internal.torchscript_exporter import utils
    except ImportError:
        yield
        return
    switch = getattr(utils, "setup_onnx_logging", None)
    utils.setup_onnx_logging = lambda verbose: nullcontext()
    try:
        yield
    finally:
        if switch is not None:
            utils.setup_onnx_logging = switch
