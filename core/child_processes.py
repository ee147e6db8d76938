"""Child processes that end with Kiln however Kiln ends.

A process Kiln starts for the length of a command (``tritonserver`` for ``kiln serve``, ``torchrun`` for a
multi-process training) must not outlive it: not when Kiln is stopped by a signal it handles (the caller stops the
child then), nor when it is killed outright (SIGKILL, out of memory), which no handler sees. For that the child asks
the kernel for a signal when its parent dies (Linux ``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(sig: signal.Signals = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` for :class:`subprocess.Popen` setting the child's parent-death signal to ``sig`` (None where
    there is no ``prctl``). The signal comes when the *thread* that started the child ends: start it from the thread
    that waits on it. A parent already gone when the child asks gets no signal: the child then exits at once.
    Everything the function calls is looked up before the fork: the child of a process with threads runs only it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    parent, getppid, exit_now, number = os.getpid(), os.getppid, os._exit, int(sig)

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, number, 0, 0, 0)
        if getppid() != parent:  # the parent died before the signal was asked for
            exit_now(1)

    return preexec
