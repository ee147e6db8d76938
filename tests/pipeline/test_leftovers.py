"""What a command killed mid-write leaves behind (staging folders, temporary files, scratch, the lock of a dead
process) is removed by the next run of that command, which then works; and a command whose current folder was
deleted under it still works with absolute paths, or says why in one error line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from kiln.cli import main
from tests.conftest import tiny_config_dict


@pytest.fixture(scope="module")
def dead_pid() -> int:
    """The id of a process that has ended."""
    proc = subprocess.Popen([sys.executable, "-c", ""])
    proc.wait()
    return proc.pid


def leave(folder: Path, pid: int) -> list[Path]:
    """What a killed command leaves in ``folder``: a staging folder, a temporary file, a scratch folder."""
    made = [
        folder / f".train.staging-{pid}-0123abcd",
        folder / f".out.onnx.staging-{pid}-0123abcd",
        folder / ".kiln-tmp" / f".run.scratch-{pid}-0123abcd",
    ]
    for p in made:
        p.mkdir(parents=True)
        (p / "partial").write_bytes(b"\0" * 10)
    tmp = folder / f".report.json.tmp-{pid}-0123abcd.tmp"
    tmp.write_text("{")
    return [*made, tmp]


def test_a_workdir_left_by_a_killed_run_is_cleaned_and_works(tmp_path: Path, dead_pid: int) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / ".kiln.lock").write_text(f"pid {dead_pid} on somehost\n")  # the lock file of a dead run
    left = leave(work, dead_pid)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config_dict(**{"train.epochs": 1})))
    result = CliRunner().invoke(main, ["train", str(cfg), "-w", str(work)])
    assert result.exit_code == 0, result.output
    assert not [p for p in left if p.exists()] and not (work / ".kiln-tmp").exists()
    assert (work / "train" / "manifest.json").is_file()
    assert f"pid {os.getpid()}" in (work / ".kiln.lock").read_text()


def test_a_killed_direct_command_leftovers_go_with_the_next_run(tmp_path: Path, dead_pid: int) -> None:
    """Beside ``-o``: the dead process's staging and scratch go; a live process's (another command now writing
    there) are left alone."""
    left = leave(tmp_path, dead_pid)
    live = tmp_path / f".out.onnx.staging-{os.getppid()}-0123abcd"
    live.mkdir()
    args = ["export", "--model", "cnn", "--input-shape", "1,8,8", "-o", str(tmp_path / "out.onnx")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert not [p for p in left if p.exists() and "train" not in p.name] and live.is_dir()
    assert (tmp_path / "out.onnx").is_file()


def deleted_cwd(tmp_path: Path) -> tuple[Path, Path]:
    gone = tmp_path / "gone"
    gone.mkdir()
    return gone, tmp_path / "out.onnx"


def test_deleted_working_folder_absolute_paths_still_work(tmp_path: Path) -> None:
    """A fresh process (torch loads without a current folder too), every path absolute."""
    gone, out = deleted_cwd(tmp_path)
    code = f"import os, sys; os.chdir({str(gone)!r}); os.rmdir({str(gone)!r}); from kiln.cli import main; main()"
    args = ["export", "--model", "cnn", "--input-shape", "1,8,8", "-o", str(out)]
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert out.is_file()


@pytest.mark.parametrize("args", [["run"], ["export", "--model", "cnn", "--input-shape", "1,8,8", "-o", "m.onnx"]])
def test_deleted_working_folder_relative_paths_say_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str]
) -> None:
    gone, _ = deleted_cwd(tmp_path)
    monkeypatch.chdir(gone)
    gone.rmdir()
    result = CliRunner().invoke(main, args)
    lines = result.output.splitlines()
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    errors = [x for x in lines if x.startswith("error:")]
    assert len(errors) == 1 and sum(x.startswith("fix:") for x in lines) == 1
    assert "no longer exists" in errors[0] and ("kiln-out" in errors[0] or "m.onnx" in errors[0])
