"""The shared memory of a PyTriton server this process made is found by its name and removed with the server's
processes. No server is started here: a folder stands in for /dev/shm."""

from __future__ import annotations

import os
from pathlib import Path

import psutil
import pytest

from kiln.serve.server import _own_resource_tracker, _Reaper, _StopRequest, pytriton_regions


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


def test_this_processs_resource_tracker_is_no_process_of_the_server() -> None:
    """PyTriton's shared memory starts this process's multiprocessing resource tracker, which ends with this process
    only: a stop that counted it among the server's processes would wait for it to its deadline, then kill it."""
    from multiprocessing import resource_tracker

    if resource_tracker._resource_tracker._pid is not None:
        pytest.skip("this process's resource tracker started before the test: the reaper leaves it be anyway")
    reaper = _Reaper(_StopRequest(), deadline_s=60.0, exit_process=False)
    resource_tracker.ensure_running()  # after the reaper, as PyTriton starts it under load
    tracker = psutil.Process(resource_tracker._resource_tracker._pid)
    reaper._look()  # what its thread does every 0.5 s
    reaper.close()
    assert tracker.is_running() and tracker.pid not in reaper._tree
    assert not _own_resource_tracker(psutil.Process())
