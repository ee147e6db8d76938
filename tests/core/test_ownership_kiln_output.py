"""An output folder holding another Kiln command's output (a `kiln precision` folder recorded in its
`.kiln-owned.json`, a `kiln build` engine, Kiln's `.kiln-cache`) is still refused, and the refusal says whose output
it is rather than calling Kiln's own files "files Kiln did not write"; a file no Kiln command wrote is still named
as such."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from click.testing import CliRunner
from pytest import MonkeyPatch

from kiln.cli import main
from kiln.core import ownership
from kiln.core.errors import ConfigError
from kiln.core.ownership import held, record_owned
from kiln.stages.engines.stage import refuse_foreign_folder
from tests.pipeline.test_faults import assert_clean, tiny_onnx


def _kiln(*args: object) -> object:
    return CliRunner().invoke(main, [str(a) for a in args])


def _precision(model: Path, out: Path) -> object:
    return _kiln("precision", model, "-o", out, "--variants", "int8")


def _error(result: object) -> str:
    return next(line for line in result.output.splitlines() if line.startswith("error:"))


def test_another_kiln_commands_output_is_named_as_such(tmp_path: Path) -> None:
    model, there = tiny_onnx(tmp_path / "m.onnx"), tmp_path / "there"
    assert _precision(model, there / "v").exit_code == 0  # there/v and Kiln's cache there/.kiln-cache
    assert _kiln("build", there / "v" / "fp32", "-o", there / "eng").exit_code == 0
    result = _precision(model, there)
    assert_clean(result, 2, "kiln precision's output recorded in v/.kiln-owned.json")
    error = _error(result)
    assert "Kiln's cache .kiln-cache" in error and "kiln build's output recorded in eng/kiln-engine.json" in error
    assert "did not write" not in error and "v/int8" not in error


def test_files_kiln_did_not_write_are_named_beside_kilns_own(tmp_path: Path) -> None:
    model, there = tiny_onnx(tmp_path / "m.onnx"), tmp_path / "there"
    assert _precision(model, there / "v").exit_code == 0
    (there / "notes.txt").write_text("the user's own")
    (there / "v" / "fp32" / "model.onnx").write_bytes(b"edited by hand")
    result = _precision(model, there)
    assert_clean(result, 2, "already holds files Kiln did not write (notes.txt, v/fp32/model.onnx)")
    assert "kiln precision's output recorded in v/.kiln-owned.json" in _error(result)
    assert (there / "notes.txt").read_text() == "the user's own"


def test_a_whole_precision_folder_is_its_output_record_and_all(tmp_path: Path) -> None:
    """What a caller refusing the whole folder (its `.kiln-owned.json` included) is told of a `kiln precision`
    folder: that command's output, not files Kiln did not write."""
    out = tmp_path / "v"
    assert _precision(tiny_onnx(tmp_path / "m.onnx"), out).exit_code == 0
    files = sorted(p for p in out.rglob("*") if p.is_file())
    assert out / ".kiln-owned.json" in files
    assert held(out, files) == "other Kiln commands' output (kiln precision's output recorded in .kiln-owned.json)"


def test_a_build_into_a_precision_folder_names_that_command_s_output(tmp_path: Path) -> None:
    """`kiln build v/fp32 -o v`: refused, as the precision folder's own output, not as files Kiln did not write."""
    out = tmp_path / "v"
    assert _precision(tiny_onnx(tmp_path / "m.onnx"), out).exit_code == 0
    result = _kiln("build", out / "fp32", "-o", out)
    assert_clean(result, 2, "already holds other Kiln commands' output (kiln precision's output recorded in")
    assert "did not write" not in _error(result)


def test_each_folder_s_records_are_read_once_however_many_files(tmp_path: Path, monkeypatch: MonkeyPatch) -> None:
    """A refusal over many files reads each folder's `.kiln-owned.json` and engine record once, not once a file."""
    out, reads = tmp_path / "out", Counter[str]()
    (out / "eng").mkdir(parents=True)
    for i in range(30):
        (out / f"kept_{i}.bin").write_bytes(b"x")
    record_owned(out)
    for i in range(30):
        (out / "eng" / f"user_{i}.txt").write_text("u")
    (out / "eng" / "kiln-engine.json").write_text(json.dumps({"file_hashes": {"model.plan": "0"}}))
    for name in ("owned_files", "_engine_files"):
        real = getattr(ownership, name)
        monkeypatch.setattr(ownership, name, lambda d, real=real, name=name: reads.update([name]) or real(d))
    said = held(out, sorted(p for p in out.rglob("*") if p.is_file()))
    assert "files Kiln did not write (eng/user_0.txt, eng/user_1.txt" in said
    assert "a Kiln command's output recorded in .kiln-owned.json" in said
    assert "kiln build's output recorded in eng/kiln-engine.json" in said
    assert reads == {"owned_files": 2, "_engine_files": 2}  # out and out/eng, each once


def test_a_huge_foreign_folder_is_looked_at_only_as_far_as_the_message_needs(
    tmp_path: Path, monkeypatch: MonkeyPatch
) -> None:
    """`kiln build -o` over a folder holding a big dataset: a few files are named, the rest said to be there, and
    only as many are classified as the message can show."""
    out, looked = tmp_path / "out", []
    for i in range(3 * ownership.EXAMINED):
        (out / "dataset" / f"part_{i // 100}").mkdir(parents=True, exist_ok=True)
        (out / "dataset" / f"part_{i // 100}" / f"row_{i}.txt").write_text("u")
    real = ownership.kiln_output
    monkeypatch.setattr(ownership, "kiln_output", lambda *a: looked.append(a[1]) or real(*a))
    with pytest.raises(ConfigError) as refused:
        refuse_foreign_folder(out)
    assert "files Kiln did not write (dataset/part_0/row_0.txt, dataset/part_0/row_1.txt" in refused.value.message
    assert refused.value.message.endswith("and more files; building there would replace them")
    assert len(looked) <= ownership.EXAMINED
