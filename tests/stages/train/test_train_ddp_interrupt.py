"""A `kiln train` with 2 gloo processes that is stopped (SIGTERM, Ctrl-C, or killed outright) takes torchrun and
its workers with it: none trains on into the workdir."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # torchrun: two training processes per test

CONFIG = {
    "seed": 1,
    "model": {"name": "transformer", "params": {"dim": 16, "heads": 2, "layers": 1}},
    "data": {"name": "synthetic", "params": {"size": 256}},
    "train": {
        "epochs": 1000,  # far longer than the test waits
        "batch_size": 32,
        "precision": "fp32",
        "device": "cpu",
        "plot": False,
        "distributed": {"nproc_per_node": 2},
        "checkpoint": {"every_steps": 1},
    },
}


def _children(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            found.update(int(c) for c in task.read_text().split())
        except OSError:
            pass
    return found


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for a parent to reap it."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _start_training(tmp_path: Path) -> tuple[subprocess.Popen[bytes], set[int]]:
    """`kiln train` with 2 processes, once both train (last.pt written): the process and its descendants' ids."""
    ckpt = tmp_path / "ck"
    config = tmp_path / "c.json"
    config.write_text(
        json.dumps({**CONFIG, "train": {**CONFIG["train"], "checkpoint": {"every_steps": 1, "dir": str(ckpt)}}})
    )
    kiln = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from kiln.cli import command; command()",
            "train",
            str(config),
            "-w",
            str(tmp_path / "w"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while not (ckpt / "last.pt").is_file():
        assert kiln.poll() is None, "kiln train ended before training"
        assert time.monotonic() < deadline, "no checkpoint within 120 s"
        time.sleep(0.2)
    launcher = _children(kiln.pid)
    workers = {w for p in launcher for w in _children(p)}
    assert len(launcher) == 1 and len(workers) >= 2, (launcher, workers)
    return kiln, launcher | workers


def _all_gone(pids: set[int], within_s: float) -> set[int]:
    deadline = time.monotonic() + within_s
    while (left := {p for p in pids if _alive(p)}) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _stop(pids: set[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=lambda s: s.name)
def test_stopping_kiln_stops_torchrun_and_its_workers(tmp_path: Path, sig: signal.Signals) -> None:
    kiln, descendants = _start_training(tmp_path)
    try:
        kiln.send_signal(sig)
        rc = kiln.wait(60)
        left = _all_gone(descendants, 30)
        assert not left, f"still running after kiln exited ({rc}): {left}"
        assert rc == {signal.SIGTERM: 143, signal.SIGINT: 130, signal.SIGKILL: -9}[sig]
    finally:
        _stop(descendants | {kiln.pid})
