"""A Triton Python-backend stub that outlives its server ends itself.

Triton starts one stub process per model instance and stops it when the server shuts down. A server that is killed
(SIGKILL, the out-of-memory killer) or exits while requests are in flight can leave its stubs running, re-parented
to PID 1, each holding its engine's memory and the shared-memory region the server made for it, and the stub ignores
SIGTERM. Nothing in Triton ends such a stub, so the one Kiln writes watches its parent: when the server is gone it
removes the region its command line names (no process is left to use it) and exits.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

REGION_PREFIX = "triton_python_backend_shm_region_"
POLL_S = 1.0


def own_regions(cmdline: Path = Path("/proc/self/cmdline")) -> list[Path]:
    """The shared-memory regions this stub's command line names (Triton passes the region's name to its stub)."""
    try:
        args = cmdline.read_bytes().split(b"\0")
    except OSError:
        return []
    names = [a.decode(errors="replace") for a in args if a.startswith(REGION_PREFIX.encode())]
    return [Path("/dev/shm") / n for n in names if "/" not in n]


def exit_with_server(
    exit_now: Callable[[int], None] = os._exit, poll_s: float = POLL_S, getppid: Callable[[], int] = os.getppid
) -> threading.Thread:
    """Start a daemon thread that ends this process once its parent (the Triton server) is gone: its parent PID
    changes when the parent dies. ``exit_now`` is ``os._exit`` (the stub's own shutdown path waits on the server)."""
    server = getppid()
    regions = own_regions()

    def watch() -> None:
        while getppid() == server:
            time.sleep(poll_s)
        for region in regions:
            try:
                region.unlink(missing_ok=True)
            except OSError:  # another user's region, or /dev/shm gone: the exit matters more
                pass
        exit_now(0)

    thread = threading.Thread(target=watch, name="kiln-stub-parent", daemon=True)
    thread.start()
    return thread
