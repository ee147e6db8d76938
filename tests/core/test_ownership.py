"""Kiln writes only where it owns the place: a file it did not write at an output path is refused, a link someone
else put where it would write is never followed, and temporary files live inside the workdir or beside -o and are
gone afterwards, also with HOME unset or odd."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from kiln.calibration.ranges import calibrate
from kiln.cli import main
from kiln.core.errors import StorageError
from kiln.core.ownership import (
    claim_folder,
    final_of,
    inductor_cache_dir,
    output_file,
    record_owned,
    scratch_root,
    temp_name,
)
from tests.calibration.calib_graphs import batches, saved
from tests.conftest import tiny_config_dict

EXPORT = ["export", "--model", "cnn", "--input-shape", "1,8,8"]


def one_error(result, *needles: str) -> None:
    """Exit 2, exactly one ``error:`` and one ``fix:`` line, no traceback."""
    lines = result.output.splitlines()
    assert result.exit_code == 2, result.output
    assert sum(x.startswith("error:") for x in lines) == 1 and sum(x.startswith("fix:") for x in lines) == 1
    assert "Traceback" not in result.output
    for n in needles:
        assert n in result.output, result.output


def command(name: str, tmp: Path) -> tuple[list[str], Path]:
    """The command line of ``name`` writing to ``tmp/out`` and the path inside it that a foreign file takes."""
    model = str(saved(tmp))
    out = tmp / "out"
    return {
        "export": ([*EXPORT, "-o", str(out)], out),
        "export-data": ([*EXPORT, "-o", str(out)], tmp / "out.data"),
        "optimize": (["optimize", model, "-o", str(out)], out),
        "precision": (["precision", model, "-o", str(out), "--variants", "fp16"], out / "notes.txt"),
        "build": (["build", model, "-o", str(out)], out / "notes.txt"),
        "loadtest": (["loadtest", "http://127.0.0.1:9", "--model", "m", "-e", str(tmp), "-o", str(out)], out),
    }[name]


@pytest.mark.parametrize("name", ["export", "export-data", "optimize", "precision", "build", "loadtest"])
def test_a_file_kiln_did_not_write_is_never_replaced(tmp_path: Path, name: str) -> None:
    args, foreign = command(name, tmp_path)
    if name == "loadtest":
        foreign = foreign / "loadtest.json"
    foreign.parent.mkdir(parents=True, exist_ok=True)
    foreign.write_text("the user's own")
    one_error(CliRunner().invoke(main, args), "Kiln did not write")
    assert foreign.read_text() == "the user's own"


@pytest.mark.parametrize("name", ["export", "optimize", "precision", "build", "loadtest-file", "lock", "cache"])
def test_a_link_someone_planted_is_never_followed(tmp_path: Path, name: str) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("keep")
    if name in ("lock", "cache"):  # the workdir's own lock file and cache folder
        work = tmp_path / "work"
        work.mkdir()
        (work / ".kiln.lock").symlink_to(target)
        if name == "cache":
            (work / ".kiln.lock").unlink()
            (work / ".kiln.lock").write_text("")
            (tmp_path / "dir").mkdir()
            (work / "cache").symlink_to(tmp_path / "dir")
        result = CliRunner().invoke(main, ["train", "-w", str(work), "--set", "train.epochs=1"])
        one_error(result, "symbolic link")
        assert target.read_text() == "keep" and not any((tmp_path / "dir").iterdir() if name == "cache" else [])
        return
    args, out = command("loadtest" if name == "loadtest-file" else name, tmp_path)
    link = out / "loadtest.json" if name == "loadtest-file" else out
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)
    result = CliRunner().invoke(main, args)
    one_error(result)
    assert "symbolic link" in result.output or "Kiln did not write" in result.output
    assert target.read_text() == "keep" and link.is_symlink()


@pytest.mark.parametrize("name", ["export", "optimize"])
def test_a_file_kiln_wrote_is_replaced_by_the_next_run(tmp_path: Path, name: str) -> None:
    args, out = command(name, tmp_path)
    for _ in range(2):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, result.output
    assert out.is_file() and not [p for p in tmp_path.iterdir() if ".staging-" in p.name or p.name == ".kiln-tmp"]


def test_an_output_folder_changed_since_kiln_wrote_it_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with output_file(out / "a.onnx") as staged:
        staged.write_text("kiln's")
    claim_folder(out, "-o", ["a.onnx"])  # unchanged: Kiln's own
    (out / "a.onnx").write_text("edited by hand")
    with pytest.raises(StorageError, match="already exists and Kiln did not write it"):
        with output_file(out / "a.onnx"):
            pass
    record_owned(out, ["a.onnx"])
    claim_folder(out, "-o", ["a.onnx"])


def test_no_temporary_file_outside_the_output_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Calibration (cached or not) and the fp16/int8 variants leave nothing in the system's temporary folder, and
    the scratch beside -o is removed."""
    system_tmp = tmp_path / "system-tmp"
    system_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(system_tmp))
    model = str(saved(tmp_path))
    for i, cache in enumerate(("true", "false")):
        out = tmp_path / f"out{i}"
        args = ["precision", model, "-o", str(out), "--variants", "fp16,int8", "--set", f"calibration.cache={cache}"]
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, result.output
    assert not list(system_tmp.iterdir()) and not (tmp_path / ".kiln-tmp").exists()
    ranges = calibrate(Path(model), batches(), "input", "minmax", cache_dir=None)
    assert ranges.path is None and not list(system_tmp.iterdir())  # uncached ranges: nothing written at all


def test_scratch_lives_in_the_workdir_and_goes(tmp_path: Path) -> None:
    with scratch_root(tmp_path) as root:
        assert Path(tempfile.mkdtemp()).parent == root and root.parent == tmp_path / ".kiln-tmp"
    assert not (tmp_path / ".kiln-tmp").exists() and tempfile.gettempdir() != str(root)


def test_folders_the_scratch_made_go_with_it_unless_something_was_written(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), scratch_root(tmp_path / "a" / "b"):
        raise RuntimeError("the command failed before writing its output")
    assert list(tmp_path.iterdir()) == []  # a failed `kiln optimize X -o a/b/m.onnx` leaves no empty a/b
    with scratch_root(tmp_path / "a" / "b"):
        (tmp_path / "a" / "b" / "m.onnx").write_bytes(b"")
    assert [p.name for p in (tmp_path / "a" / "b").iterdir()] == ["m.onnx"]


def test_scratch_of_a_relative_workdir_is_named_absolutely(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`-w kiln-out` (the default) is relative: the temporary folder handed to libraries is not, since a compiler
    they start from another folder (Inductor's g++ for a torch CPU engine) would not find a relative one."""
    monkeypatch.chdir(tmp_path)
    with scratch_root(Path("kiln-out")) as root:
        assert root.is_absolute() and root.parent == tmp_path / "kiln-out" / ".kiln-tmp"
        assert Path(os.environ["TMPDIR"]).is_absolute() and Path(tempfile.gettempdir()).is_absolute()


def test_nothing_inductor_noted_in_a_run_names_the_removed_scratch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inductor notes its cache folder (TORCHINDUCTOR_CACHE_DIR) and its precompiled headers' folder from the
    temporary folder on first use, for the rest of the process. Taken inside a run, they named the removed scratch
    after it: later compiles started cold and wrote into the workdir, and the next AOTInductor build failed on a
    missing header."""
    from torch._inductor import codecache
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr(codecache, "_HEADER_DIR", codecache._HEADER_DIR)  # put back after the test
    with scratch_root(tmp_path / "run") as root:
        assert Path(cache_dir()).parent == root  # noted from the scratch, as on a first compile in a run
        codecache._HEADER_DIR = str(root / "torchinductor_root" / "precompiled_headers")  # imported in a run
        local = codecache.CacheBase.get_local_cache_path()
        assert local.is_relative_to(root)
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    assert codecache._HEADER_DIR == os.path.join(inductor_cache_dir(), "precompiled_headers")
    assert not codecache.CacheBase.get_local_cache_path().is_relative_to(root)
    noted = str(tmp_path / "mine")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", noted)  # the user's own setting holds through a run
    with scratch_root(tmp_path / "run"):
        assert cache_dir() == noted
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == noted


@pytest.mark.parametrize("home", [None, "missing", "file", "read-only"])
def test_home_unset_or_odd(tmp_path: Path, home: str | None) -> None:
    """HOME unset, missing, a file or unwritable: a run (matplotlib's loss plot included) works, with every
    temporary and cache file inside the workdir, and nothing left in the system's temporary folder."""
    if home == "read-only" and os.geteuid() == 0:
        pytest.skip("root writes into a read-only folder")
    places = {"missing": tmp_path / "nope", "file": tmp_path / "home-file", "read-only": tmp_path / "ro"}
    places["file"].write_text("")
    places["read-only"].mkdir(mode=0o500)
    env = {k: v for k, v in os.environ.items() if k not in ("HOME", "MPLCONFIGDIR", "XDG_CACHE_HOME")}
    if home is not None:
        env["HOME"] = str(places[home])
    env["TMPDIR"] = str(tmp_path / "system-tmp")
    (tmp_path / "system-tmp").mkdir()
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config_dict(**{"train.epochs": 1})))
    work = tmp_path / "work"
    run = [sys.executable, "-m", "kiln.cli", "run", str(cfg), "-w", str(work), "--until", "train", "-q"]
    proc = subprocess.run(run, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr
    assert not list((tmp_path / "system-tmp").iterdir()) and not (work / ".kiln-tmp").exists()
    assert (work / "train" / "loss.png").is_file()


def test_a_staging_name_gives_back_the_path_it_stands_in_for(tmp_path: Path) -> None:
    assert final_of(temp_name(tmp_path / "train", "staging")) == tmp_path / "train"
    assert final_of(temp_name(tmp_path / "train", "old")) is None  # another kind of temporary name
    assert final_of(tmp_path / "train") is None
