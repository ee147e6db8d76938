"""The server processes `kiln serve` starts end with it however it ends (SIGKILL included), and a port an orphaned
``tritonserver`` holds is named with its process. No Triton server is started here: ``sleep`` and a Python
listener stand in for it (the slow end-to-end check is in test_server.py)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from kiln.serve.server import PortInUse, _listener_pid, check_ports

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a parent-death signal is Linux's")

# A `kiln serve` stand-in: starts a long-lived child through the helper tritonserver_process uses, from its main
# thread, says the child's pid and waits to be killed.
PARENT = textwrap.dedent(
    """
    import subprocess, sys, time
    from pathlib import Path
    from kiln.serve.server import server_popen

    child = server_popen(["sleep", "600"], None, Path(sys.argv[1]), subprocess.DEVNULL)
    print(child.pid, flush=True)
    time.sleep(600)
    """
)


def _gone(pid: int, timeout_s: float) -> bool:
    """Whether process ``pid`` ends (or is a zombie nobody reaps yet) within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_a_server_process_ends_with_a_parent_killed_outright(tmp_path: Path) -> None:
    """SIGKILL of `kiln serve` once left tritonserver (and its stubs) serving on, re-parented to PID 1, from a
    scratch folder the next command removed, holding the ports: now it gets SIGTERM when its parent dies."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    child = 0
    try:
        child = int(parent.stdout.readline())  # type: ignore[union-attr]
        assert psutil.Process(child).ppid() == parent.pid
        parent.kill()
        parent.wait(timeout=60)
        assert _gone(child, 10.0), "the server process outlived the kiln process that started it"
    finally:
        parent.kill()
        parent.wait()
        if child:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_the_listener_of_a_port_is_found(tmp_path: Path) -> None:
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        assert _listener_pid(listening.getsockname()[1]) == os.getpid()
    with socket.socket() as bound_only:  # bound, not listening: nobody to name
        bound_only.bind(("127.0.0.1", 0))
        assert _listener_pid(bound_only.getsockname()[1]) is None


def test_a_port_an_orphaned_tritonserver_holds_names_it(tmp_path: Path) -> None:
    """A `tritonserver` from a `kiln serve` scratch folder whose parent is gone: the fix line names it to kill."""
    program = tmp_path / "kiln-serve-abc" / "tritonserver" / "bin" / "tritonserver"  # the process's name and path
    program.parent.mkdir(parents=True)
    program.symlink_to(sys.executable)
    port_file = tmp_path / "port"
    listen = (
        "import socket, time; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
        f"open({str(port_file)!r}, 'w').write(str(s.getsockname()[1])); time.sleep(600)"
    )
    # started by a shell that exits at once: orphaned, as a killed kiln serve leaves its server
    subprocess.run(["sh", "-c", '"$0" -c "$1" >/dev/null 2>&1 &', str(program), listen], check=True, timeout=60)
    deadline = time.monotonic() + 60
    while not (port_file.is_file() and port_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    port = int(port_file.read_text())
    pid = _listener_pid(port)
    try:
        assert pid is not None and psutil.Process(pid).name() == "tritonserver"
        with pytest.raises(PortInUse, match=f"port {port} on 127.0.0.1 is in use") as busy:
            check_ports("127.0.0.1", port)
        assert busy.value.hint == f"a tritonserver (pid {pid}) left by an earlier kiln serve holds it: kill {pid}"
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
