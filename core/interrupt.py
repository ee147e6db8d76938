"""Ctrl-C and SIGTERM that stop a command even when Python drops the interrupt.

Python raises ``KeyboardInterrupt`` wherever the main thread is when SIGINT arrives; inside a weakref callback or a
finalizer (the garbage collector runs them between any two bytecodes) it is printed as "Exception ignored" and
lost, and the run goes on. While :func:`handled` is active, the handler also records the interrupt, and
:func:`check` raises it again at the next stage boundary.

SIGTERM (what ``timeout``, CI runners and ``docker stop`` send) is handled the same way while :func:`handled` is
active: the same ``KeyboardInterrupt`` unwinds the command through the same ``finally`` blocks (its staging folders
and scratch removed), where Python's default would end the process on the spot and leave them; :func:`last_signal`
says which signal it was. A plain ``KeyboardInterrupt``, not a subclass, as code that tests its type exactly
(``subprocess.Popen``'s exit: no waiting for a child) treats Ctrl-C. A command that stops on its own terms
(``kiln serve``) installs its own handlers inside the block, over these.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from types import FrameType
from typing import Any

_seen = threading.Event()
_last: list[int] = []  # the signal the last interrupt came by (SIGINT or SIGTERM), since handled() began
_owner: list[int] = []  # the process that installed the handlers (a forked child inherits them)


def _on_signal(signum: int, frame: FrameType | None) -> None:
    if signum == signal.SIGTERM and _owner and os.getpid() != _owner[0]:
        # a forked worker (multiprocessing, a DataLoader's) stopped by its parent: it ends as it would have
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    _last[:] = [signum]
    _seen.set()
    raise KeyboardInterrupt


def _unraisable_but_ctrl_c(report: Any, info: Any) -> None:
    """Python's report of an error it could not raise, except the interrupt :func:`check` raises again."""
    if not isinstance(info.exc_value, KeyboardInterrupt):
        report(info)


def last_signal() -> int | None:
    """The signal the last interrupt came by (``signal.SIGINT`` or ``signal.SIGTERM``) since :func:`handled`
    began, or None."""
    return _last[0] if _last else None


def by_sigterm() -> bool:
    """Whether the last interrupt since :func:`handled` began came by SIGTERM (``timeout``, ``kill``, CI, ``docker
    stop``), not Ctrl-C."""
    return last_signal() == signal.SIGTERM


@contextmanager
def handled() -> Iterator[None]:
    """SIGINT and SIGTERM through :func:`_on_signal` for the block (main thread only, where Python allows a
    handler), and no "Exception ignored" traceback for the interrupt it swallows; the previous handlers and hook
    come back after it. :func:`last_signal` keeps saying which signal came after the block, for its caller."""
    _seen.clear()
    _last.clear()
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signals = (signal.SIGINT, signal.SIGTERM)
    previous, report = {s: signal.getsignal(s) for s in signals}, sys.unraisablehook
    _owner[:] = [os.getpid()]
    for s in signals:
        signal.signal(s, _on_signal)
    sys.unraisablehook = partial(_unraisable_but_ctrl_c, report)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)  # None: one set outside Python
        sys.unraisablehook = report
        _seen.clear()


def check() -> None:
    """Raise ``KeyboardInterrupt`` (once) if Ctrl-C or SIGTERM came and was swallowed."""
    if _seen.is_set():
        _seen.clear()
        raise KeyboardInterrupt
