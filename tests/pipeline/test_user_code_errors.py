"""User code fails as the user's code: a model factory, forward, data function, loss or calibration reader that
raises, at its first call or a later one, is named with its file:line and what Kiln was doing, in one ``error:`` and
one ``fix:`` line; the traceback only with --verbose."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from kiln.calibration.config import CalibrationConfig
from kiln.calibration.data import read_reader
from kiln.cli import main
from kiln.core.user_errors import UserCodeError

SOURCE = """
import torch
from torch import nn
from kiln import DatasetSplits

FAIL = {fail!r}
CALLS = {{"forward": 0, "loss": 0}}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 2)

    def forward(self, x):
        CALLS["forward"] += 1
        if FAIL == "forward" and CALLS["forward"] > 4:
            raise RuntimeError("forward broke")  # FAILS forward
        if FAIL == "dtype":  # a float32 tensor made here meets the bf16 output autocast gives the Linear
            at = torch.zeros(len(x), 2, dtype=torch.long)
            return torch.zeros(len(x), 2).scatter_add(1, at, self.l(x))  # FAILS dtype
        return self.l(x)


def build():
    if FAIL == "factory":
        raise RuntimeError("factory broke")  # FAILS factory
    return Net()


def load():
    if FAIL == "data":
        raise KeyError("no column 'label'")  # FAILS data
    if FAIL == "data-file":
        open("labels.csv").read()  # FAILS data-file
    g = torch.Generator().manual_seed(0)
    x = torch.rand(64, 4, generator=g)
    y = (x[:, 0] > 0.5).long()
    return DatasetSplits(x[:48], y[:48], x[48:], y[48:], num_classes=2)


def loss(out, y):
    CALLS["loss"] += 1
    if FAIL == "loss-first":
        raise ValueError("loss broke")  # FAILS loss-first
    if FAIL == "loss" and CALLS["loss"] > 3:
        raise ValueError("loss broke")  # FAILS loss
    return nn.functional.cross_entropy(out, y)


def reader():
    yield torch.rand(4, 4).numpy()
    raise OSError("camera offline")  # FAILS reader
"""

# failing function -> (what the error names, what Kiln was doing)
CASES = {
    "factory": ("model factory", "while building the model"),
    "data": ("data function", "while loading data"),
    "data-file": ("data function", "while loading data"),
    # forward fails from its 5th call: the probe's, the two of the check that it is deterministic, then 2 steps
    "forward": ("forward()", "while training step 2 (epoch 1)"),
    "loss-first": ("loss function", "train.loss on the model's outputs"),
    "loss": ("loss()", "while training step 3 (epoch 1)"),
}


def project(tmp_path: Path, fail: str, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, str, int]:
    """A user's module (named per test: imported fresh) and config; returns the config, module name and the line
    that raises."""
    name = f"ucerr_{fail.replace('-', '_')}"
    src = textwrap.dedent(SOURCE.format(fail=fail))
    (tmp_path / f"{name}.py").write_text(src)
    line = next((i for i, text in enumerate(src.splitlines(), 1) if text.endswith(f"# FAILS {fail}")), 0)
    cfg = {
        "model": {"name": f"{name}:build"},
        "data": {"name": f"{name}:load"},
        "train": {"epochs": 1, "batch_size": 8, "loss": f"{name}:loss", "plot": False},
        "signature": {"batch_sizes": [1]},
        "calibration": {"reader": f"{name}:reader", "num_batches": 4},
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return tmp_path / "c.yaml", name, line


@pytest.mark.parametrize("fail", sorted(CASES))
def test_user_code_raising_names_its_file_line_and_what_kiln_was_doing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail: str
) -> None:
    cfg, name, line = project(tmp_path, fail, monkeypatch)
    result = CliRunner().invoke(main, ["train", str(cfg), "-w", str(tmp_path / "w")])
    lines = result.output.splitlines()
    errors = [x for x in lines if x.startswith("error:")]
    assert result.exit_code == 2, result.output
    assert len(errors) == 1 and sum(x.startswith("fix:") for x in lines) == 1, result.output
    assert "Traceback" not in result.output
    what, doing = CASES[fail]
    assert what in errors[0] and doing in errors[0] and f"{name}.py:{line}" in errors[0], errors[0]
    if fail == "data-file":  # a path relative to the working folder: the fix says which folder that was
        assert f"relative to the current folder {tmp_path}" in result.output


def test_a_dtype_clash_under_autocast_says_so_and_how_to_train_without(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg, name, line = project(tmp_path, "dtype", monkeypatch)
    args = ["train", str(cfg), "-w", str(tmp_path / "w"), "--set", "train.precision=bf16"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    error = next(x for x in result.output.splitlines() if x.startswith("error:"))
    assert f"{name}.py:{line}" in error and "while training step 1 (epoch 1) under bf16 autocast" in error, error
    assert "train without autocast (train.precision: fp32)" in result.output
    assert "in a loss, compare outputs.float() with the targets" in result.output  # a loss's bf16 outputs, too
    result = CliRunner().invoke(main, [*args[:-1], "train.precision=fp32"])  # the same code trains without it
    assert result.exit_code == 0, result.output


def test_verbose_shows_the_users_traceback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, name, line = project(tmp_path, "loss", monkeypatch)
    result = CliRunner().invoke(main, ["train", str(cfg), "-w", str(tmp_path / "w"), "-v"])
    assert result.exit_code == 2
    assert "Traceback" in result.output and f'{name}.py", line {line}, in loss' in result.output
    assert sum(x.startswith("error:") for x in result.output.splitlines()) == 1


def test_a_calibration_reader_failing_after_its_first_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, name, line = project(tmp_path, "reader", monkeypatch)
    with pytest.raises(UserCodeError, match=rf"calibration reader '{name}:reader' raised OSError: camera offline"):
        read_reader(CalibrationConfig(reader=f"{name}:reader", num_batches=4))
    with pytest.raises(UserCodeError, match=rf"{name}.py:{line}\) while reading calibration batches"):
        read_reader(CalibrationConfig(reader=f"{name}:reader", num_batches=4))


def test_kiln_own_errors_are_not_blamed_on_the_user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A factory given params it does not take is a config mistake (no frame of the user's file raised)."""
    cfg, name, _ = project(tmp_path, "none", monkeypatch)
    result = CliRunner().invoke(main, ["train", str(cfg), "-w", str(tmp_path / "w"), "--set", "model.params={a: 1}"])
    assert result.exit_code == 2 and "rejected its params" in result.output and "Traceback" not in result.output
