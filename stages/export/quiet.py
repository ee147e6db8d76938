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


@contextmanager
def quiet_torch() -> Iterator[None]:
    """The exporter prints progress chatter and warns about optional torchvision ops, and torch.export prints the
    graph it failed on to stderr (twice) and logs the symbol it could not place: keep the user's console clean,
    the failure's own message says why (what was said goes to the debug log, which --verbose shows)."""
    quiet = [logging.getLogger(n) for n in ("torch.onnx", SHAPES_LOG)]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.ERROR)
    said = io.StringIO()
    try:
        with warnings.catch_warnings(), redirect_stdout(said), redirect_stderr(said), _no_torchscript_log():
            warnings.simplefilter("ignore")
            yield
    finally:
        for q, level in zip(quiet, levels):
            q.setLevel(level)
        if said.getvalue().strip():  # what the exporter, or the model's own prints, said meanwhile: --verbose
            log.debug("while exporting:\n%s", said.getvalue())


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
