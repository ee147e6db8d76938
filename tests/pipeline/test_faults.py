"""Faults and bad inputs through the CLI: each one is one `error:` line and one `fix:` line with its exit code,
never a traceback, and nothing good is lost (issue 14's cases, one test per class of fault)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from kiln.cli import main
from kiln.core import artifacts
from tests.conftest import tiny_config_dict


def invoke(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_clean(result, code: int, *needles: str) -> None:
    out = result.output
    assert result.exit_code == code, out
    assert "Traceback" not in out and result.exception is None or isinstance(result.exception, SystemExit), out
    lines = out.splitlines()
    assert sum(ln.startswith("error:") for ln in lines) == 1, out
    assert sum(ln.startswith("fix:") for ln in lines) == 1, out
    for needle in needles:
        assert needle in out, out


def tiny_onnx(path: Path, external: bool = False) -> Path:
    """input [batch, 4] float -> MatMul -> logits [batch, 3]."""
    w = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(4, 3), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["input", "w"], ["logits"])],
        "tiny",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 3])],
        [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    if external:
        onnx.save_model(model, str(path), save_as_external_data=True, location=path.name + ".data", size_threshold=0)
    else:
        onnx.save_model(model, str(path))
    return path


# ------------------------------------------------------------------------------------------------ disk faults
def _fail_writes(monkeypatch, when) -> None:
    """Every atomic write for which ``when(path)`` holds fails as a full disk would."""
    real = artifacts.write_bytes_atomic

    def full(path: Path, data: bytes) -> None:
        if when(Path(path)):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real(path, data)

    monkeypatch.setattr(artifacts, "write_bytes_atomic", full)


@pytest.fixture
def short_config(write_yaml) -> Path:
    return write_yaml(tiny_config_dict(**{"train.epochs": 1}))


def test_disk_full_in_a_stage_keeps_finished_stages_and_writes_the_report(monkeypatch, tmp_path, short_config):
    wd = tmp_path / "wd"
    _fail_writes(monkeypatch, lambda p: p.name == "manifest.json" and ".optimize.staging" in p.parent.name)
    result = invoke("run", short_config, "-w", wd, "--until", "optimize")
    assert_clean(result, 2, "no space left on the device", "running stage 'optimize'", "resumes")
    assert (wd / "train" / "manifest.json").is_file() and (wd / "export" / "manifest.json").is_file()
    assert not (wd / "optimize").exists() and not list(wd.glob(".*staging*"))  # nothing half-written
    report = json.loads((wd / "report.json").read_text())
    assert report["ok"] is False and "no space left" in report["error"]
    monkeypatch.undo()
    resumed = invoke("run", short_config, "-w", wd, "--until", "optimize", "--quiet")
    assert resumed.exit_code == 0, resumed.output
    assert json.loads((wd / "report.json").read_text())["stages"]["train"]["status"] == "cached"


def test_disk_full_for_the_report_too_says_so(monkeypatch, tmp_path, short_config):
    wd = tmp_path / "wd"
    _fail_writes(
        monkeypatch,
        lambda p: (p.name == "manifest.json" and ".export.staging" in p.parent.name) or p.name.startswith("report."),
    )
    result = invoke("run", short_config, "-w", wd, "--until", "export")
    assert_clean(result, 2, "no space left on the device", "the report was not written either")
    assert (wd / "train" / "manifest.json").is_file() and not (wd / "report.md").exists()


@pytest.fixture
def readonly(tmp_path: Path):
    """A folder nobody may write to: a read-only tmpfs when running as root (root ignores permissions)."""
    folder = tmp_path / "ro"
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)
        return
    if (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(folder)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("root, and no read-only mount possible here")
    yield folder
    subprocess.run(["umount", str(folder)], check=False)


@pytest.mark.parametrize("command", ["build", "optimize", "export", "run"])
def test_read_only_output(readonly: Path, tmp_path: Path, command: str) -> None:
    model = tiny_onnx(tmp_path / "m.onnx")
    args = {
        "build": ["build", model, "-o", readonly / "engine"],
        "optimize": ["optimize", model, "-o", readonly / "m.opt.onnx"],
        "export": ["export", "--checkpoint", model, "-o", readonly / "m.onnx"],
        "run": ["run", "-w", readonly / "wd"],
    }[command]
    assert_clean(invoke(*args), 2, "read-only file system" if os.geteuid() == 0 else "permission denied", str(readonly))


def test_build_refuses_an_output_folder_holding_other_files(tmp_path: Path) -> None:
    model = tiny_onnx(tmp_path / "m.onnx")
    mine = tmp_path / "out"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    assert_clean(invoke("build", model, "-o", mine), 2, "already holds files Kiln did not write", "notes.txt")
    assert (mine / "notes.txt").read_text() == "mine"
    fresh = invoke("build", model, "-o", tmp_path / "engine")
    again = invoke("build", model, "-o", tmp_path / "engine")  # its own earlier engine may be replaced
    assert fresh.exit_code == 0 and again.exit_code == 0, again.output


# ------------------------------------------------------------------------------------------------ bad inputs
def test_impossible_batch_is_refused_before_allocating(tmp_path: Path, short_config) -> None:
    model = tiny_onnx(tmp_path / "m.onnx")
    assert invoke("build", model, "-o", tmp_path / "e").exit_code == 0
    huge = ["--set", "signature.batch_sizes=[1, 1000000000]"]
    result = invoke("validate", tmp_path / "e", "--reference", model, *huge)
    assert_clean(result, 2, "signature.batch_sizes: a batch of 1000000000 samples needs", "GiB", "lower")
    result = invoke("run", short_config, "-w", tmp_path / "wd", "--until", "build", *huge)  # profiles, autotuning
    assert_clean(result, 2, "a batch of 1000000000 samples needs", "lower signature.batch_sizes")


def test_missing_external_data(tmp_path: Path) -> None:
    model = tiny_onnx(tmp_path / "m.onnx", external=True)
    (tmp_path / "m.onnx.data").unlink()
    for args in (["build", model, "-o", tmp_path / "e"], ["optimize", model, "-o", tmp_path / "o.onnx"]):
        assert_clean(invoke(*args), 2, "external-data file", "is missing", "m.onnx.data")


def test_truncated_external_data(tmp_path: Path) -> None:
    model = tiny_onnx(tmp_path / "m.onnx", external=True)
    data = tmp_path / "m.onnx.data"
    data.write_bytes(data.read_bytes()[:8])
    for args in (["build", model, "-o", tmp_path / "e"], ["optimize", model, "-o", tmp_path / "o.onnx"]):
        assert_clean(invoke(*args), 2, "cannot read the external weights", "complete")


@pytest.mark.parametrize("command", ["build", "optimize"])
def test_empty_onnx_is_called_empty(tmp_path: Path, command: str) -> None:
    empty = tmp_path / "m.onnx"
    empty.write_bytes(b"")
    result = invoke(command, empty, "-o", tmp_path / ("e" if command == "build" else "o.onnx"))
    assert_clean(result, 2, "empty (0 bytes)")
    assert "safety net" not in result.output and "int_high" not in result.output


def test_pickled_npz_inputs_are_refused(tmp_path: Path) -> None:
    model = tiny_onnx(tmp_path / "m.onnx")
    assert invoke("build", model, "-o", tmp_path / "e").exit_code == 0
    np.savez(tmp_path / "x.npz", input=np.array([{"a": 1}, None], dtype=object))
    result = invoke("validate", tmp_path / "e", "--reference", model, "--inputs", tmp_path / "x.npz")
    assert_clean(result, 2, "pickled objects")


DATA = """
import torch
from kiln import DatasetSplits

def make(case="ok"):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 1, 8, 8, generator=g), torch.randint(0, 4, (64,), generator=g)
    vx, vy = x[:16].clone(), y[:16].clone()
    if case == "rows":
        y = y[:50]
    if case == "shape":
        vx = torch.randn(16, 1, 4, 4, generator=g)
    return DatasetSplits(x, y, vx, vy, num_classes=4)
"""


@pytest.mark.parametrize(
    "case, needle",
    [
        ("rows", "train_x has 64 rows but train_y has shape [50]"),
        ("shape", "validation samples are [1, 4, 4] but training samples are [1, 8, 8]"),
    ],
)
def test_inconsistent_user_data(tmp_path: Path, write_yaml, case: str, needle: str) -> None:
    (tmp_path / "userdata_faults.py").write_text(DATA)
    cfg = write_yaml({**tiny_config_dict(), "data": {"name": "userdata_faults:make", "params": {"case": case}}})
    assert_clean(invoke("run", cfg, "-w", tmp_path / "wd"), 2, needle)


# ------------------------------------------------------------------------------------------------ hostile config
@pytest.mark.parametrize(
    "text, needle",
    [
        ("", "is empty"),
        ("# nothing but a comment\n", "is empty"),
        ("model:\n  name: cnn\nmodel:\n  name: mlp\n", "duplicate key 'model'"),
        ("validate:\n  gates:\n    min_cosine: .nan\n", "finite number"),
        ("validate:\n  gates:\n    max_accuracy_drop: .inf\n", "finite number"),
        ("validate:\n  gates:\n    min_cosine: 5\n", "less than or equal to 1"),
        ("validate:\n  gates:\n    per_precision: {int8: {min_top1_agreement: -3}}\n", "greater than or equal to 0"),
        (
            "a: &a [x, x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
            "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]\n"
            "e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]\nf: [*e, *e, *e, *e, *e, *e, *e, *e, *e, *e]\n",
            "aliases",
        ),
        ("model: {name: cnnn}\n", "unknown model 'cnnn'"),
    ],
)
def test_hostile_or_wrong_config(tmp_path: Path, text: str, needle: str) -> None:
    cfg = tmp_path / "kiln.yaml"
    cfg.write_text(text)
    command = "run" if "cnnn" in text else "config"
    assert_clean(invoke(command, cfg, "-w", tmp_path / "wd") if command == "run" else invoke(command, cfg), 2, needle)


def test_duplicate_keys_in_json_config(tmp_path: Path) -> None:
    cfg = tmp_path / "kiln.json"
    cfg.write_text('{"train": {"epochs": 1, "epochs": 5}}')
    assert_clean(invoke("config", cfg), 2, "duplicate key 'epochs'")


# ------------------------------------------------------------------------------------------------ damaged state
def test_damaged_lock_file_does_not_crash(tmp_path: Path, short_config) -> None:
    wd = tmp_path / "wd"
    wd.mkdir()
    (wd / ".kiln.lock").write_bytes(b"\xff\xfe\x00garbage")
    result = invoke("run", short_config, "-w", wd, "--until", "train", "--quiet")
    assert result.exit_code == 0, result.output
    (wd / ".kiln.lock").unlink()
    (wd / ".kiln.lock").mkdir()
    assert_clean(invoke("run", short_config, "-w", wd, "--until", "train"), 2, ".kiln.lock is not a file")
    assert (wd / ".kiln.lock").is_dir()  # never removed


def test_damaged_engine_metadata_is_refused(tmp_path: Path) -> None:
    model = tiny_onnx(tmp_path / "m.onnx")
    assert invoke("build", model, "-o", tmp_path / "e").exit_code == 0
    (tmp_path / "e" / "kiln-engine.json").write_text('{"name": 3')
    assert_clean(invoke("validate", tmp_path / "e", "--reference", model), 2)


def test_a_folder_of_the_users_is_not_taken_as_workdir(tmp_path: Path, short_config) -> None:
    mine = tmp_path / "project"
    (mine / "train").mkdir(parents=True)
    (mine / "train" / "data.csv").write_text("1,2\n")
    assert_clean(
        invoke("run", short_config, "-w", mine, "--until", "train"), 2, "already holds files Kiln did not write"
    )
    assert (mine / "train" / "data.csv").read_text() == "1,2\n" and sorted(p.name for p in mine.iterdir()) == ["train"]


@pytest.mark.parametrize("value, needle", [(".nan", "finite number"), ("{a: 1, a: 2}", "duplicate key")])
def test_hostile_set_values(value: str, needle: str) -> None:
    key = "validate.gates.min_cosine" if value == ".nan" else "model.params"
    result = invoke("config", "--set", f"{key}={value}")
    assert result.exit_code == 2 and needle in result.output and "Traceback" not in result.output, result.output


def test_a_really_full_disk(tmp_path: Path, short_config) -> None:
    """Not injected: a 120 kB tmpfs (root only) fills up somewhere in the pipeline."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=120k", "tmpfs", str(disk)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("needs root and tmpfs to make a small filesystem")
    try:
        result = invoke("run", short_config, "-w", disk / "wd")
        assert_clean(result, 2, "no space left on the device")
        wd = disk / "wd"
        report_written = (wd / "report.json").is_file()
        assert report_written or "the report was not written either" in result.output
        for manifest in wd.glob("*/manifest.json"):  # every finished stage is whole
            data = json.loads(manifest.read_text())
            assert all((manifest.parent / rel).stat().st_size == n for rel, n in data["sizes"].items())
        assert not list(wd.glob(".*staging*"))
    finally:
        subprocess.run(["umount", str(disk)], check=False)
