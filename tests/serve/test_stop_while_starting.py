"""Ctrl-C or SIGTERM at any moment of `kiln serve`'s start stops it: exit 130 (143), one error/fix pair saying
nothing was served, no URLs and no `ready` line, nothing of the server left running.

Each point of the start is reached for certain, however fast or loaded the machine: the signal is sent by
`kiln serve` itself, from a wrapper around one step of its start (``kiln.serve.server.<step>``) that signals its own
process just before or just after the step runs. Ctrl-C in a terminal, which reaches the whole process group
(``tritonserver`` too), is sent from outside once ``tritonserver`` runs."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from kiln.pipeline.api import run_pipeline
from kiln.pipeline.config import config_from_dict
from kiln.serve.server import free_ports
from tests.conftest import tiny_config_dict

pytestmark = pytest.mark.slow  # a `kiln serve` process per test

# A hang guard, not a speed test: a stop before ready takes well under a second idle, and no pass depends on load
STOP_TIMEOUT_S = 300

# Gone within this of the signal: the server's own bound on a stop (docs/serving.md), measured in well under 1 s
GONE_WITHIN_S = 10.0

# `python -c DRIVER STEP before|after SIGNAL STAMP kiln-args...`: `kiln serve` with one step of its start wrapped to
# send SIGNAL to its own process before or after the step runs, writing the time it did so to the file STAMP
DRIVER = """
import os, signal, sys, time
from pathlib import Path
import kiln.serve.server as server
from kiln.cli import main

name, when, sig, stamp = sys.argv[1], sys.argv[2], getattr(signal, sys.argv[3]), Path(sys.argv[4])
step = getattr(server, name)

def signalled(*args, **kwargs):
    if when == "before":
        stamp.write_text(str(time.time()))
        os.kill(os.getpid(), sig)
    result = step(*args, **kwargs)
    if when == "after":
        stamp.write_text(str(time.time()))
        os.kill(os.getpid(), sig)
    return result

setattr(server, name, signalled)
sys.argv = ["kiln", *sys.argv[5:]]
main()
"""

SAID = {
    signal.SIGINT: (130, "Ctrl-C"),
    signal.SIGTERM: (143, "SIGTERM"),
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("serve-stop") / "run"
    result, _ = run_pipeline(config_from_dict(tiny_config_dict()), out)
    assert result.ok
    return out


def _served(tmp_path: Path, workdir: Path) -> Path:
    """A copy of the run's workdir for one server: its scratch folder (.kiln-tmp) is this test's alone."""
    copy = tmp_path / "run"
    shutil.copytree(workdir, copy)
    return copy


class _Descendants:
    """Every process seen under ``pid`` while it runs (a stub orphaned when its server dies is no longer under it)."""

    def __init__(self, pid: int) -> None:
        self.seen: set[psutil.Process] = set()
        self._root = psutil.Process(pid)
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while True:
            try:
                self.seen |= set(self._root.children(recursive=True))
            except psutil.Error:  # gone: it ended
                return
            time.sleep(0.02)

    def names(self) -> set[str]:
        found = set()
        for p in list(self.seen):
            try:
                found.add(p.name())
            except psutil.Error:  # gone
                pass
        return found

    def left(self) -> list[psutil.Process]:
        self._thread.join(timeout=10)
        _, alive = psutil.wait_procs(list(self.seen), timeout=STOP_TIMEOUT_S)
        return alive


def _stopped_before_ready(proc: subprocess.Popen[str], watch: _Descendants, served: Path, sig: int) -> None:
    """``proc`` ends with ``sig``'s exit code, saying only that it was stopped before it was ready; nothing of the
    server is left: no process, no scratch folder."""
    try:
        out, err = proc.communicate(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"kiln serve did not stop; it printed:\n{out}\n{err}") from None
    code, name = SAID[sig]
    assert proc.returncode == code, f"exit {proc.returncode}; stdout:\n{out}\nstderr:\n{err}"
    assert out == "", out  # no URLs
    assert err.splitlines() == [
        f"error: kiln serve was stopped ({name}) before the server was ready: nothing was served",
        "fix: run `kiln serve` again and stop it after its `ready` line (it comes once every engine answers)",
    ], err
    assert not watch.left(), "left running"
    scratch = served / ".kiln-tmp"
    assert not scratch.exists() or not list(scratch.iterdir()), list(scratch.iterdir())


# (step, before or after it, --pytriton): from the command's start to a server that answers but was not yet said
# to be ready
POINTS = [
    ("_is_workdir", "before", False),  # before the server's own handlers: the command's (kiln.core.interrupt)
    ("find_engines", "after", False),  # the server's handlers, nothing started
    ("write_repository", "after", False),
    ("tritonserver_process", "after", False),  # tritonserver starting, unaware of the signal
    ("load_engine", "after", True),
    ("_bind_or_explain", "before", True),  # PyTriton's server runs, the model about to load into it
]


@pytest.mark.parametrize(("step", "when", "pytriton"), POINTS, ids=[f"{w}-{s}{'-pytriton' * p}" for s, w, p in POINTS])
def test_ctrl_c_at_any_point_of_the_start_stops_it_saying_nothing_was_served(
    workdir: Path, tmp_path: Path, step: str, when: str, pytriton: bool
) -> None:
    _stop_at(workdir, tmp_path, step, when, pytriton, signal.SIGINT)


def test_sigterm_while_triton_starts_exits_143(workdir: Path, tmp_path: Path) -> None:
    _stop_at(workdir, tmp_path, "tritonserver_process", "after", False, signal.SIGTERM)


@pytest.mark.parametrize("pytriton", [False, True], ids=["stubs", "pytriton"])
def test_a_stop_once_the_server_answers_is_its_normal_end(workdir: Path, tmp_path: Path, pytriton: bool) -> None:
    """Signalled just after Kiln's own poll found Triton ready, before `ready` is said: a client or a readiness
    probe polling Triton may have been answered already, so this is no stop before ready (the server's tests that
    poll Triton and then stop it saw exit 143 "nothing was served" when their poll came first): `ready` is said,
    exit 0, nothing left running."""
    proc, watch, served, stamp = _signalled_at(workdir, tmp_path, "wait_ready", "after", pytriton, signal.SIGINT)
    out, err = proc.communicate(timeout=STOP_TIMEOUT_S)
    assert proc.returncode == 0, f"exit {proc.returncode}; stdout:\n{out}\nstderr:\n{err}"
    assert "ready (Ctrl-C or SIGTERM stops the server)" in err and "error:" not in err, err
    assert not watch.left(), "left running"
    assert time.time() - float(stamp.read_text()) < GONE_WITHIN_S


def _signalled_at(
    workdir: Path, tmp_path: Path, step: str, when: str, pytriton: bool, sig: int
) -> tuple[subprocess.Popen[str], _Descendants, Path, Path]:
    """`kiln serve` started with ``sig`` sent to itself ``when`` (before or after) ``step`` of its start runs."""
    served = _served(tmp_path, workdir)
    ports = free_ports(3)
    args = ["serve", str(served), "--http-port", str(ports[0]), "--grpc-port", str(ports[1])]
    args += ["--metrics-port", str(ports[2]), *(["--pytriton"] if pytriton else [])]
    stamp = tmp_path / "signalled"
    cmd = [sys.executable, "-c", DRIVER, step, when, signal.Signals(sig).name, str(stamp), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, _Descendants(proc.pid), served, stamp


def _stop_at(workdir: Path, tmp_path: Path, step: str, when: str, pytriton: bool, sig: int) -> None:
    proc, watch, served, stamp = _signalled_at(workdir, tmp_path, step, when, pytriton, sig)
    _stopped_before_ready(proc, watch, served, sig)
    took = time.time() - float(stamp.read_text())  # to the end of the process, and then of what it left
    print(f"{step} ({when}{', --pytriton' * pytriton}): gone {took:.2f} s after the signal")
    assert took < GONE_WITHIN_S


@pytest.mark.parametrize("group", [True, False], ids=["terminal-ctrl-c", "kiln-serve-alone"])
def test_ctrl_c_while_triton_starts_is_a_stop_not_an_error(workdir: Path, tmp_path: Path, group: bool) -> None:
    """Sent from outside once ``tritonserver`` runs: to the whole process group, as a terminal's Ctrl-C
    (``tritonserver`` exits while it starts, which once read as "error: the Triton server exited while starting"),
    or to `kiln serve` alone (the server starts on: it once said `ready` and exited 0)."""
    served = _served(tmp_path, workdir)
    ports = free_ports(3)
    cmd = [sys.executable, "-m", "kiln.cli", "serve", str(served), "--http-port", str(ports[0])]
    cmd += ["--grpc-port", str(ports[1]), "--metrics-port", str(ports[2])]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    watch = _Descendants(proc.pid)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while "tritonserver" not in watch.names() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert "tritonserver" in watch.names(), f"no tritonserver started; kiln serve printed:\n{proc.communicate()}"
    sent = time.time()
    if group:
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(signal.SIGINT)
    _stopped_before_ready(proc, watch, served, signal.SIGINT)
    assert time.time() - sent < GONE_WITHIN_S
