"""Ctrl-C that stops a command even when Python drops it.

Python raises ``KeyboardInterrupt`` wherever the main thread is when SIGINT arrives; inside a weakref callback or a
finalizer (the garbage collector runs them between any two bytecodes) it is printed as "Exception ignored" and
lost, and the run goes on. While :func:`handled` is active, the handler also records the interrupt, and
:func:`check` raises it again at the next stage boundary.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from types import FrameType
from typing import Any

_seen = threading.Event()


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    _seen.set()
    raise KeyboardInterrupt


def _unraisable_but_ctrl_c(report: Any, info: Any) -> None:
    """Python's report of an error it could not raise, except the interrupt :func:`check` raises again."""
    if not isinstance(info.exc_value, KeyboardInterrupt):
        report(info)


@contextmanager
def handled() -> Iterator[None]:
    """SIGINT through :func:`_on_sigint` for the block (main thread only, where Python allows a handler), and no
    "Exception ignored" traceback for the Ctrl-C it swallows; the previous handler and hook come back after it."""
    _seen.clear()
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous, report = signal.getsignal(signal.SIGINT), sys.unraisablehook
    signal.signal(signal.SIGINT, _on_sigint)
    sys.unraisablehook = partial(_unraisable_but_ctrl_c, report)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        sys.unraisablehook = report
        _seen.clear()


def check() -> None:
    """Raise ``KeyboardInterrupt`` (once) if Ctrl-C came and was swallowed."""
    if _seen.is_set():
        _seen.clear()
        raise KeyboardInterrupt
