import errno
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kiln.core.errors import InputFileError, WorkdirBusy
from kiln.pipeline import workdir_lock as wl


def test_a_second_holder_is_refused_and_the_lock_ends_with_the_first(tmp_path: Path) -> None:
    with wl.workdir_lock(tmp_path):
        with pytest.raises(WorkdirBusy, match=r"in use by another kiln run \(pid \d+ on "):
            with wl.workdir_lock(tmp_path):
                pass
    with wl.workdir_lock(tmp_path):  # released: free again
        pass


def test_unwritable_workdir_is_a_clean_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(InputFileError, match="cannot write in workdir") as err:
        with wl.workdir_lock(tmp_path / "file" / "run"):
            pass
    assert "writable --workdir" in err.value.hint


def test_filesystem_without_locks_runs_unlocked_with_a_warning(tmp_path: Path, monkeypatch, caplog) -> None:
    def no_locks(*_a) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(wl.fcntl, "flock", no_locks)
    monkeypatch.setattr(logging.getLogger("kiln"), "propagate", True)  # the CLI tests turn it off
    with caplog.at_level(logging.WARNING, logger="kiln.workdir"):
        with wl.workdir_lock(tmp_path):
            ran = True
    assert ran and "cannot be locked (No locks available)" in caplog.text


# A process that holds a workdir (as `kiln serve` or as `kiln run`), says so and waits to be killed.
HOLDER = """
import sys, time
from pathlib import Path
from kiln.pipeline import workdir_lock as wl

with (wl.served_workdir if sys.argv[2] == "serve" else wl.workdir_lock)(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(600)
"""


@contextmanager
def _held_by_another_process(workdir: Path, how: str) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(workdir), how], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_a_served_workdir_refuses_a_run_until_its_server_dies(tmp_path: Path) -> None:
    with wl.served_workdir(tmp_path) as marked:  # this process's server
        assert marked
        with pytest.raises(
            WorkdirBusy, match=rf"workdir {tmp_path} is being served by kiln serve \(pid {os.getpid()}\)"
        ):
            with wl.workdir_lock(tmp_path):
                pass
        with wl.served_workdir(tmp_path):  # servers of one workdir share it
            pass
    with _held_by_another_process(tmp_path, "serve") as server:
        with pytest.raises(WorkdirBusy, match=rf"being served by kiln serve \(pid {server.pid}\)") as busy:
            with wl.workdir_lock(tmp_path):
                pass
        assert busy.value.hint == "stop the server first, or run into another workdir with -w"
        server.kill()  # killed outright: its mark goes with it, its line stays, naming a dead process
        server.wait()
        assert f"kiln serve pid {server.pid} on" in (tmp_path / wl.LOCK_NAME).read_text()
        with wl.workdir_lock(tmp_path):
            pass


def test_a_workdir_a_run_holds_is_not_served_until_the_run_dies(tmp_path: Path) -> None:
    with wl.workdir_lock(tmp_path):
        with pytest.raises(WorkdirBusy, match=rf"in use by a kiln run \(pid {os.getpid()} on "):
            with wl.served_workdir(tmp_path):
                pass
    with _held_by_another_process(tmp_path, "run") as run:
        with pytest.raises(WorkdirBusy, match=rf"workdir {tmp_path} is in use by a kiln run \(pid {run.pid} on "):
            with wl.served_workdir(tmp_path):
                pass
        run.kill()
        run.wait()
        with wl.served_workdir(tmp_path) as marked:
            assert marked


def test_a_workdir_whose_lock_cannot_be_written_is_served_unmarked(tmp_path: Path, monkeypatch) -> None:
    def read_only(*_a, **_k) -> int:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(wl, "open_nofollow", read_only)
    with wl.served_workdir(tmp_path) as marked:
        assert not marked
