"""The shared memory of a PyTriton server this process made is found by its name and removed with the server's
processes. No server is started here: a folder stands in for /dev/shm."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kiln.serve.server import _Reaper, _StopRequest, pytriton_regions


def _regions(folder: Path, pid: int) -> tuple[Path, Path, Path]:
    """A region of ``pid``'s PyTriton server, one of a process whose pid starts with ``pid``'s digits, and a plain
    Python-backend region."""
    ours = folder / f"pytrtion{pid}-5998931e75a03df0-7e3f-424d-8303-8dfec48fafbd"
    other = folder / f"pytrtion{pid}7-4b1a94f62131290b-31ca-4d63-b779-5207c0beb33a"
    plain = folder / "triton_python_backend_shm_region_01d00134"
    for f in (ours, other, plain):
        f.write_bytes(b"\0" * 64)
    return ours, other, plain


def test_pytriton_regions_are_those_named_after_this_process(tmp_path: Path) -> None:
    ours, _, _ = _regions(tmp_path, 1234)
    assert pytriton_regions(tmp_path, 1234) == {str(ours)}
    assert pytriton_regions(tmp_path / "missing", 1234) == set()


def test_the_reaper_removes_the_pytriton_region_a_stopped_server_left(tmp_path: Path) -> None:
    """PyTriton's regions are named after the process that made the server (this one): what is left of them once
    the server's stop returned is removed; another process's region and the Python backend's are left alone."""
    ours, other, plain = _regions(tmp_path, os.getpid())
    reaper = _Reaper(_StopRequest(), deadline_s=60.0, exit_process=False)
    reaper.shm_dir = tmp_path
    reaper.close()  # no stop was asked and no process of the server runs: it returns at once
    assert not ours.exists()
    assert other.exists() and plain.exists()


# run in a fresh interpreter: a test process whose tracker an earlier test started could not show the reaper
# leaving one alone that starts after it, as PyTriton's does under load
_TRACKER_CHECK = """
import psutil
from multiprocessing import resource_tracker
from kiln.serve.server import _own_resource_tracker, _Reaper, _StopRequest
assert resource_tracker._resource_tracker._pid is None
reaper = _Reaper(_StopRequest(), deadline_s=60.0, exit_process=False)
resource_tracker.ensure_running()
tracker = psutil.Process(resource_tracker._resource_tracker._pid)
reaper._look()
reaper.close()
assert tracker.is_running() and tracker.pid not in reaper._tree, "the tracker was taken for a server process"
assert not _own_resource_tracker(psutil.Process())
"""


def test_this_processs_resource_tracker_is_no_process_of_the_server() -> None:
    """PyTriton's shared memory starts this process's multiprocessing resource tracker, which ends with this process
    only: a stop that counted it among the server's processes would wait for it to its deadline, then kill it."""
    done = subprocess.run([sys.executable, "-c", _TRACKER_CHECK], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


# the tracker's child runs before multiprocessing stores its pid: a look in between sees a child it cannot tell
_TRACKER_SEEN_EARLY = """
import psutil
from multiprocessing import resource_tracker
from kiln.serve.server import _Reaper, _StopRequest
reaper = _Reaper(_StopRequest(), deadline_s=60.0, exit_process=False)
resource_tracker.ensure_running()
pid = resource_tracker._resource_tracker._pid
resource_tracker._resource_tracker._pid = None  # as between the tracker's start and its pid being stored
reaper._look()
resource_tracker._resource_tracker._pid = pid
assert pid in reaper._tree  # taken for a server process while it could not be told
reaper.close()
tracker = psutil.Process(pid)
assert tracker.status() != psutil.STATUS_ZOMBIE, "the tracker seen before its pid was stored was killed"
"""


def test_a_tracker_seen_before_its_pid_was_stored_is_left_alone_at_the_stop() -> None:
    """Under load a look can fall between the tracker's start and multiprocessing storing its pid: the stop still
    tells it apart from the server's processes (it neither waits for it nor kills it)."""
    done = subprocess.run([sys.executable, "-c", _TRACKER_SEEN_EARLY], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
