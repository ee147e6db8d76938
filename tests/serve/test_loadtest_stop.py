"""A load test stopped by SIGTERM while its client processes send from shared memory: each process ends its level
and unregisters its regions, so the server holds none of them afterwards and none is left in /dev/shm. A small
HTTP server in this process stands in for Triton's shared-memory and inference routes."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.serve.json_handler import JsonHandler

# two client processes of two threads each, tensors in shared memory, for far longer than the test runs
DRIVER = r"""
import sys
import numpy as np
from kiln.core import interrupt
from kiln.serve.loadtest import run_level_processes

pool = [{"x": np.full((1, 4), i, np.float32)} for i in range(4)]
expected = [{"y": 2 * p["x"]} for p in pool]
with interrupt.handled():
    try:
        run_level_processes(2, "http", sys.argv[1], "m", pool, expected, (1e-5, 1e-4), 4, 300.0, 10**9, True)
    except KeyboardInterrupt:
        print("stopped", flush=True)
"""


class _Triton(JsonHandler):
    """Triton's system shared-memory routes (register, unregister, status) and an inference route that refuses each
    request a moment later: the client goes on sending until it is stopped."""

    protocol_version = "HTTP/1.1"
    state = SimpleNamespace(registered=set(), seen=set(), requests=0, lock=threading.Lock())

    def do_GET(self) -> None:
        with self.state.lock:
            self.reply(200, [{"name": n} for n in sorted(self.state.registered)])

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        parts = self.path.strip("/").split("/")
        if parts[1] == "systemsharedmemory" and parts[-1] in ("register", "unregister"):
            with self.state.lock:
                if parts[-1] == "register":
                    self.state.registered.add(parts[3])
                    self.state.seen.add(parts[3])
                else:
                    self.state.registered.discard(parts[3])
            return self.reply(200, {})
        time.sleep(0.02)
        with self.state.lock:
            self.state.requests += 1
        self.reply(400, {"error": "not a model"})


@pytest.fixture
def triton() -> Iterator[tuple[str, SimpleNamespace]]:
    _Triton.state = SimpleNamespace(registered=set(), seen=set(), requests=0, lock=threading.Lock())
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Triton)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}", _Triton.state
    server.shutdown()
    server.server_close()


@pytest.mark.slow
def test_a_stopped_load_test_of_client_processes_leaves_no_shared_memory_region(triton) -> None:
    pytest.importorskip("tritonclient.http", reason="needs the serving libraries (pip install 'kiln[serve]')")
    address, state = triton
    proc = subprocess.Popen(
        [sys.executable, "-c", DRIVER, address], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        # both processes have laid out their regions (one for the pool, one per thread) and send requests
        while proc.poll() is None and not (len(state.seen) >= 6 and state.requests >= 4):
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "stopped" in out, err
    assert state.registered == set(), (state.registered, err)
    assert not [n for n in state.seen if Path(f"/dev/shm/{n}").exists()]
    assert "leaked shared_memory" not in err and "Traceback" not in err, err


class _Worker:
    """A client process that ends on SIGTERM (``obeys``) or only when killed; a join of one still running lasts its
    whole timeout on ``clock``."""

    def __init__(self, obeys: bool, clock: list[float]) -> None:
        self.obeys, self.alive, self.clock, self.signals = obeys, True, clock, []

    def is_alive(self) -> bool:
        return self.alive

    def terminate(self) -> None:
        self.signals.append("TERM")
        self.alive = not self.obeys

    def kill(self) -> None:
        self.signals.append("KILL")
        self.alive = False

    def join(self, timeout: float | None = None) -> None:
        if self.alive:
            assert timeout is not None or "KILL" in self.signals, "an unbounded wait for a running process"
            self.clock[0] += timeout or 0.0


def test_stopped_client_processes_are_signalled_then_waited_for_together_and_the_rest_killed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import kiln.serve.loadtest as loadtest
    from kiln.serve.loadtest import end_workers

    clock = [100.0]
    monkeypatch.setattr(loadtest.time, "monotonic", lambda: clock[0])
    workers = [_Worker(False, clock), _Worker(False, clock), _Worker(True, clock)]
    end_workers(workers, stop=True, wait_s=3.0)
    assert [w.signals for w in workers] == [["TERM", "KILL"], ["TERM", "KILL"], ["TERM"]]
    assert clock[0] - 100.0 <= 3.0  # one deadline for all, not 3 s each
    finished = [_Worker(True, clock)]
    finished[0].alive = False
    end_workers(finished, stop=True, wait_s=3.0)  # a process that ended by itself gets no signal
    assert finished[0].signals == []
