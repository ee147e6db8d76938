"""The stub's watch on its server: it ends the process, and removes the region it was given, once the parent is
gone (a server killed outright leaves its stubs otherwise)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from kiln.serve.stub_parent import exit_with_server, own_regions


def test_regions_come_from_the_command_line(tmp_path: Path) -> None:
    cmdline = tmp_path / "cmdline"
    cmdline.write_bytes(
        b"triton_python_backend_stub\0/m/1/model.py\0triton_python_backend_shm_region_ab-12\0"
        b"1048576\0../escape/triton_python_backend_shm_region_x\0"
    )
    assert own_regions(cmdline) == [Path("/dev/shm/triton_python_backend_shm_region_ab-12")]
    assert own_regions(tmp_path / "absent") == []


def test_the_watch_exits_once_the_parent_pid_changes() -> None:
    parents = iter([10, 10, 10, 1])  # the server's PID at start, twice alive, then re-parented to init
    exits: list[int] = []
    exit_with_server(exits.append, poll_s=0.001, getppid=lambda: next(parents, 1)).join(timeout=60)
    assert exits == [0]


def test_a_process_whose_parent_is_killed_ends_itself(tmp_path: Path) -> None:
    """A real parent killed outright: its child (watching, as a stub does) is gone within seconds, not left to init."""
    child = (
        "import time, sys; from kiln.serve.stub_parent import exit_with_server; exit_with_server(poll_s=0.05); "
        "print('watching', flush=True); time.sleep(600)"
    )
    relay = (  # the parent starts the child, waits until it watches, then says the child's PID
        f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', {child!r}], "
        "stdout=subprocess.PIPE, text=True); p.stdout.readline(); print(p.pid, flush=True); time.sleep(600)"
    )
    parent = subprocess.Popen([sys.executable, "-c", relay], stdout=subprocess.PIPE, text=True)
    pid = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 120  # a hang guard: the child's watch polls every 0.05 s
    while time.monotonic() < deadline and Path(f"/proc/{pid}").exists() and _state(pid) != "Z":
        time.sleep(0.05)
    assert not Path(f"/proc/{pid}").exists() or _state(pid) == "Z", f"child {pid} outlived its parent"


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"
