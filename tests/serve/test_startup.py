"""A server that cannot start says so at once: ports checked as the servers bind them, socket paths the OS
refuses, a server process that dies while starting. No server is started here."""

from __future__ import annotations

import signal
import socket
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from kiln.core.errors import KilnError
from kiln.serve.server import (
    MAX_SOCKET_PATH,
    PortInUse,
    ServerDied,
    _died_while_starting,
    _ready_or_dead,
    _Reaper,
    _signals_to,
    _Stopped,
    _StopRequest,
    check_ports,
    check_socket_folder,
    free_ports,
    socket_folder,
    stopped_by,
    wait_ready,
)


def _time_wait_port() -> int:
    """A port whose server closed its side of a connection first: left in TIME_WAIT, as a killed server leaves it
    (its listener with SO_REUSEADDR, as Triton's HTTP and gRPC servers set it; Linux then lets a new socket with
    SO_REUSEADDR bind the port)."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = listener.accept()
    conn.close()  # the server side closes first: its port goes to TIME_WAIT
    listener.close()
    client.recv(1)
    client.close()
    return port


def test_a_port_left_in_time_wait_is_not_called_busy() -> None:
    port = _time_wait_port()
    with socket.socket() as plain, pytest.raises(OSError):  # without SO_REUSEADDR the port looks taken
        plain.bind(("127.0.0.1", port))
    check_ports("127.0.0.1", port)  # as Triton binds it: free


def test_a_listening_port_is_busy_and_bad_ports_and_addresses_are_named() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(PortInUse, match=f"port {port} on 127.0.0.1 is in use"):
            check_ports("127.0.0.1", port)
    with pytest.raises(PortInUse, match="not a TCP port"):
        check_ports("127.0.0.1", 70000)
    with pytest.raises(PortInUse, match="same port is given twice"):
        check_ports("127.0.0.1", 9000, 9000)
    with pytest.raises(PortInUse, match="not an address of this machine"):
        check_ports("192.0.2.1", 9000)  # TEST-NET-1: never a local address
    with pytest.raises(PortInUse, match="cannot be resolved"):
        check_ports("no-such-host.invalid", 9000)


def test_a_socket_path_over_the_os_limit_is_refused_before_starting(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * (MAX_SOCKET_PATH - len(str(tmp_path))))
    with pytest.raises(KilnError, match="over the OS limit") as info:
        check_socket_folder(deep, ["model"])
    assert "TMPDIR" in info.value.hint and not deep.exists()
    check_socket_folder(tmp_path / "ok", ["model"])  # bound, then removed: PyTriton makes its own folder
    assert not (tmp_path / "ok").exists()


def test_a_deep_tmpdir_puts_the_sockets_in_a_short_folder_else_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kiln.serve.server as server

    deep = tmp_path / ("d" * (MAX_SOCKET_PATH - len(str(tmp_path))))
    short = socket_folder(deep, ["model"])
    assert len(str(short)) < MAX_SOCKET_PATH and not short.exists()
    short.parent.rmdir()
    monkeypatch.setattr(server, "SHORT_SOCKET_ROOT", tmp_path / "missing")  # no short folder to fall back on
    with pytest.raises(KilnError, match="over the OS limit"):
        socket_folder(deep, ["model"])


def test_a_folder_that_refuses_sockets_is_named() -> None:
    with tempfile.TemporaryDirectory(dir="/tmp") as short:  # pytest's tmp_path can exceed the socket path limit
        (Path(short) / "file").write_text("")
        with pytest.raises(KilnError, match="socket folder"):
            check_socket_folder(Path(short) / "file" / "pytriton", ["model"])  # a file where the folder would go


class _Server:
    def __init__(self, alive: bool) -> None:
        self.alive = alive

    def is_alive(self) -> bool:
        return self.alive

    def logs(self) -> str:
        return "I0101 12:00:00.0 1 server.cc:1] starting\nE0101 12:00:01.0 1 main.cc:2] failed to bind port 8001\n"


class _NeverReady:
    def is_server_ready(self, headers: Any = None) -> bool:
        raise ConnectionRefusedError

    def is_server_live(self, headers: Any = None) -> bool:
        return False


def test_a_model_that_failed_to_load_gets_the_fix_for_its_own_cause() -> None:
    stub = _died_while_starting("failed to load 'm' version 1: Internal: ModuleNotFoundError: No module named 'zmq'")
    gpu = _died_while_starting("failed to load 'm' version 1: Invalid argument: instance group m_0 specifies gpu id 0")
    assert "install the module" in stub.hint
    assert "m: Invalid argument" in str(gpu) and "install the module" not in gpu.hint


def test_a_server_that_died_while_starting_ends_the_wait_with_its_error() -> None:
    wait = _ready_or_dead(lambda: _Server(alive=False))
    with pytest.raises(ServerDied, match="exited while starting: failed to bind port 8001"):
        wait(_NeverReady(), timeout_s=600)  # returns at the first look, not after the timeout


def test_the_reaper_kills_the_servers_processes_and_leaves_the_callers_own() -> None:
    """An in-process ``serve`` (a test, a notebook) beside a server its caller started: only what was started after
    the reaper is the server's, and only that is killed when it outlives the stop."""
    import subprocess
    import sys

    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    callers = subprocess.Popen(sleeper)
    try:
        reaper = _Reaper(_StopRequest(), deadline_s=60.0, exit_process=False)
        servers = subprocess.Popen(sleeper)
        reaper._look()  # what its thread does every 0.5 s
        reaper.close()  # no stop was asked: an error path, 2 s for the server's processes, then killed
        assert servers.wait(timeout=30) == -9
        assert callers.poll() is None
    finally:
        callers.kill()
        callers.wait()


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm on this machine")
def test_a_killed_servers_shared_memory_region_is_removed(tmp_path: Path) -> None:
    """A server killed at its deadline cannot remove the Python backend's region in /dev/shm: the reaper, which
    read what the server mapped when the stop came, removes it; another file there is left alone."""
    import os
    import subprocess
    import sys

    from kiln.serve.server import SHM_REGION

    region, other = Path(f"{SHM_REGION}_kilntest_{os.getpid()}"), Path(f"/dev/shm/kilntest_other_{os.getpid()}")
    for f in (region, other):
        f.write_bytes(b"\0" * 4096)
    mapper = f"import mmap, time; f = open({str(region)!r}, 'r+b'); m = mmap.mmap(f.fileno(), 0); time.sleep(60)"
    try:
        reaper = _Reaper(_StopRequest(), deadline_s=60.0, exit_process=False)
        server = subprocess.Popen([sys.executable, "-c", mapper])
        deadline = time.monotonic() + 30
        while not reaper._shm and time.monotonic() < deadline:  # until the child has mapped it
            reaper._look()
            reaper._regions()
            time.sleep(0.1)
        reaper.close()
        assert server.wait(timeout=30) == -9
        assert not region.exists() and other.exists()
    finally:
        region.unlink(missing_ok=True)
        other.unlink(missing_ok=True)


class _Ready(BaseHTTPRequestHandler):
    """Answers Triton's server-readiness route, as its HTTP endpoint does once it is up."""

    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/v2/health/ready" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def test_ready_waits_for_the_other_ports_to_listen_too() -> None:
    """Triton opens its metrics port after its HTTP one: a ready HTTP endpoint with a port not yet listening is
    not ready (a test reading the metrics right after readiness was refused on a busy machine)."""
    http = ThreadingHTTPServer(("127.0.0.1", 0), _Ready)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    late = socket.socket()
    late.bind(("127.0.0.1", 0))  # bound, not listening: connections refused
    url = f"http://127.0.0.1:{http.server_address[1]}"
    try:
        wait_ready(url, [], timeout_s=5)  # the HTTP endpoint alone is ready
        with pytest.raises(KilnError, match="not ready within 1 s"):
            wait_ready(url, [], timeout_s=1, listening=(late.getsockname()[1],))
        threading.Timer(0.5, late.listen).start()
        started = time.monotonic()
        wait_ready(url, [], timeout_s=30, listening=(late.getsockname()[1],))
        assert time.monotonic() - started >= 0.4
    finally:
        http.shutdown()
        http.server_close()
        late.close()


def test_ports_picked_together_are_all_different_and_free() -> None:
    ports = free_ports(64)
    assert len(set(ports)) == 64  # a server's three ports never come back the same
    for port in ports[:3]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))  # free: let go once picked


def test_a_stop_while_starting_ends_the_start_and_a_stop_once_served_does_not() -> None:
    """The first signal is a flag that the start's next step or poll reads (:class:`_Stopped`), and it ends the step
    that waits on the server (``abort_start``); once served, a stop is the serving loop's to read."""
    aborted: list[bool] = []
    stop = _StopRequest()
    stop.abort_start = lambda: aborted.append(True)
    stop.check()  # nothing asked: the start goes on
    stop(signal.SIGTERM, None)
    assert aborted == [True] and stopped_by() == signal.SIGTERM
    with pytest.raises(_Stopped):
        stop.check()
    assert stop.stopping
    stop(signal.SIGINT, None)  # the stop began: a second signal changes nothing (the reaper bounds the stop)
    assert aborted == [True] and stopped_by() == signal.SIGTERM

    served = _StopRequest()
    served.served = True
    served.abort_start = lambda: aborted.append(True)
    served(signal.SIGINT, None)
    served.check()  # ready: not a stop of the start
    assert served.requested and aborted == [True]
    with pytest.raises(KeyboardInterrupt):  # before the stop began, a second signal interrupts
        served(signal.SIGINT, None)


def test_the_waits_for_a_starting_server_end_at_a_stop() -> None:
    """Nothing answers here: the waits would poll until their timeouts; a stop ends them at their next look."""
    stop = _StopRequest()
    stop(signal.SIGINT, None)
    started = time.monotonic()
    with pytest.raises(_Stopped):
        wait_ready(f"http://127.0.0.1:{free_ports(1)[0]}", [], timeout_s=600, check=stop.check)
    with pytest.raises(_Stopped):
        _ready_or_dead(lambda: _Server(alive=True), stop.check)(_NeverReady(), timeout_s=600)
    assert time.monotonic() - started < 60


def test_a_ctrl_c_the_command_took_before_the_servers_handlers_is_a_stop() -> None:
    """A Ctrl-C that `kiln`'s own handler recorded but a finalizer swallowed, before the server's handlers took
    over, counts: the start ends at its first step."""
    from kiln.core import interrupt

    with interrupt.handled():
        interrupt._seen.set()  # as the command's handler records it
        interrupt._last[:] = [signal.SIGTERM]
        stop = _StopRequest()
        with _signals_to(stop):
            assert signal.getsignal(signal.SIGINT) is stop
            assert stop.requested and stopped_by() == signal.SIGTERM
        assert signal.getsignal(signal.SIGINT) is interrupt._on_signal  # the command's handlers are back


def test_a_process_that_exits_before_it_is_named_is_said_gone_not_a_traceback() -> None:
    """The reaper lists the server's processes, then names them in its log: one may exit in between."""
    import subprocess
    import sys

    import psutil

    from kiln.serve.server import _named

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    process = psutil.Process(child.pid)
    assert _named(process) in {f"{process.name()} ({child.pid})", f"{child.pid} (gone)"}
    child.wait()
    assert _named(process) == f"{child.pid} (gone)"
