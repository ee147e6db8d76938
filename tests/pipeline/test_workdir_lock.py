import errno
import logging
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
