"""What a call read, as Python's audit hooks report it."""

from __future__ import annotations

import glob
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.core.file_reads import recording, user_files


def test_reads_are_recorded_inside_the_block_only(tmp_path: Path) -> None:
    data, out, folder = tmp_path / "data.csv", tmp_path / "out.txt", tmp_path / "shards"
    data.write_text("1,2\n")
    folder.mkdir()
    with recording() as reads:
        data.read_text()
        out.write_text("written")  # a write is not a read
        glob.glob(str(folder / "*.csv"))
    (tmp_path / "after.txt").write_text("x")
    (tmp_path / "after.txt").read_text()
    files, folders, absent = user_files(reads, skip=[])
    assert files == [data] and folders == [folder] and absent == []
    assert reads.reached_out is None


def test_the_environment_and_skipped_folders_are_not_the_users(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file of the standard library or an installed package, a file under ``skip`` and the import system's
    listing of a folder are left out; a module of the user's is theirs."""
    (tmp_path / "kiln_fr_helper.py").write_text("X = 1\n")
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "f.txt").write_text("x")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with recording() as reads:
            importlib.import_module("kiln_fr_helper")
            Path(importlib.__file__).read_text()  # the standard library's
            Path(pytest.__file__).read_text()  # an installed package's
            (tmp_path / "kept" / "f.txt").read_text()
    finally:
        sys.modules.pop("kiln_fr_helper", None)
    assert any(p.endswith("kiln_fr_helper.py") for p in reads.files)
    # the user's module is a file read (imported by name at run time, no reading of imports finds it)
    assert user_files(reads, skip=[tmp_path / "kept"]) == ([tmp_path / "kiln_fr_helper.py"], [], [])


def test_a_subprocess_reaches_past_the_files() -> None:
    with recording() as reads:
        subprocess.run([sys.executable, "-c", "pass"], check=True)
    assert reads.reached_out == "subprocess.Popen"


def test_a_library_starting_a_process_as_it_is_imported_is_not_the_users_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """numpy runs ``lscpu`` when first imported; a user's module doing the same on import counts."""
    from kiln.core import file_reads

    body = "import subprocess, sys\nsubprocess.run([sys.executable, '-c', 'pass'], check=True)\n"
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "kiln_fr_lib.py").write_text(body)
    (tmp_path / "kiln_fr_user.py").write_text(body)
    monkeypatch.setattr(file_reads, "_roots", lambda: (tmp_path.resolve() / "lib",))
    monkeypatch.syspath_prepend(str(tmp_path / "lib"))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with recording() as library:
            importlib.import_module("kiln_fr_lib")
        with recording() as user:
            importlib.import_module("kiln_fr_user")
    finally:
        sys.modules.pop("kiln_fr_lib", None)
        sys.modules.pop("kiln_fr_user", None)
    assert library.reached_out is None and user.reached_out == "subprocess.Popen"


def test_environment_variables_read_are_recorded_but_kilns_own_per_run_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """A variable picking the data's file is an input, however it is read (a copy of the environment included);
    TMPDIR, which Kiln sets anew each run, is not."""
    import os

    monkeypatch.setenv("KILN_FR_FILE", "b.csv")
    with recording() as reads:
        os.environ.get("KILN_FR_FILE")
        os.getenv("TMPDIR")
    assert reads.environ == {"KILN_FR_FILE"}
    with recording() as copied:
        os.environ.copy().get("KILN_FR_FILE")
    assert "KILN_FR_FILE" in copied.environ and "TMPDIR" not in copied.environ
