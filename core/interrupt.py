"""Ctrl-C that stops a command even when Python drops it.

Python raises ``KeyboardInterrupt`` wherever the main thread is when SIGINT arrives; inside a weakref callback or a
finalizer (the garbage collector runs them between any two bytecodes) it is printed as "Exception ignored" and
lost, and the run goes on. The handler here also records the interrupt, and :func:`check` raises it again at the
next stage boundary.
"""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType
from typing import Any

_seen = threading.Event()
_unraisable = sys.unraisablehook


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    _seen.set()
    raise KeyboardInterrupt


def _unraisable_but_ctrl_c(info: Any) -> None:
    """Python's report of an error it could not raise, except the interrupt :func:`check` raises again."""
    if not isinstance(info.exc_value, KeyboardInterrupt):
        _unraisable(info)


def install() -> None:
    """SIGINT through :func:`_on_sigint` (main thread only, where Python allows a handler), and no "Exception
    ignored" traceback for the Ctrl-C it swallows."""
    _seen.clear()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _on_sigint)
        sys.unraisablehook = _unraisable_but_ctrl_c


def check() -> None:
    """Raise ``KeyboardInterrupt`` if Ctrl-C came and was swallowed since :func:`install`."""
    if _seen.is_set():
        raise KeyboardInterrupt
