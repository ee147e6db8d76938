"""Every command that takes ``--set`` blames a bad ``--set`` on the ``--set``, as the user typed it, never on the
config file (a held-out tester: ``kiln run kiln.yaml --set train.epochs=abc`` said "invalid config kiln.yaml" of
a file that says ``epochs: 3``); each is one ``error:`` and one ``fix:`` line, exit 2, no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from kiln.cli import main


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "kiln.yaml").write_text("train: {epochs: 3}\nprecision: {variants: [fp32, int8]}\n")
    (tmp_path / "m.onnx").write_bytes(b"")  # never read: the config is refused first
    (tmp_path / "engine").mkdir()
    return tmp_path


def _commands(p: Path) -> dict[str, list[str]]:
    """Each command that takes --set, in its workdir mode and its direct mode, by a name for the test's id."""
    cfg, wd = str(p / "kiln.yaml"), str(p / "wd")
    stages = ("train", "export", "optimize", "precision", "build", "validate", "package")
    return {
        "run": ["run", cfg, "-w", wd],
        "config": ["config", cfg],
        **{stage: [stage, cfg, "-w", wd] for stage in stages},
        "export-direct": ["export", cfg, "--model", "cnn", "-o", str(p / "x.onnx")],
        "optimize-direct": ["optimize", str(p / "m.onnx"), "-c", cfg, "-o", str(p / "o.onnx")],
        "precision-direct": ["precision", str(p / "m.onnx"), "-c", cfg, "-o", str(p / "v")],
        "build-direct": ["build", str(p / "m.onnx"), "-c", cfg, "-o", str(p / "e")],
        "validate-direct": ["validate", str(p / "engine"), "-c", cfg, "--reference", str(p / "m.onnx")],
    }


COMMANDS = list(_commands(Path(".")))


def _one_pair(result) -> tuple[str, str]:
    out = result.output
    assert result.exit_code == 2 and "Traceback" not in out, out
    errors = [ln for ln in out.splitlines() if ln.startswith("error:")]
    fixes = [ln for ln in out.splitlines() if ln.startswith("fix:")]
    assert len(errors) == 1 and len(fixes) == 1, out
    return errors[0], fixes[0]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_blames_a_bad_set_value_on_the_set(project: Path, command: str) -> None:
    args = _commands(project)[command]
    error, fix = _one_pair(CliRunner().invoke(main, [*args, "--set", "train.epochs=abc"]))
    assert error.startswith("error: invalid --set train.epochs=abc: "), (args, error)
    assert "kiln.yaml" not in error, (args, error)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_blames_an_unknown_set_key_on_the_set(project: Path, command: str) -> None:
    args = _commands(project)[command]
    error, fix = _one_pair(CliRunner().invoke(main, [*args, "--set", "train.epoch=3"]))
    assert error.startswith("error: invalid --set train.epoch=3: unknown key 'train.epoch'"), (args, error)
    assert "kiln.yaml" not in error and "--set train.epochs=3" in fix, (args, error, fix)


def test_a_bad_file_value_is_blamed_on_the_file(project: Path) -> None:
    (project / "kiln.yaml").write_text("train: {epochs: abc}\n")
    error, _ = _one_pair(CliRunner().invoke(main, ["config", str(project / "kiln.yaml"), "--set", "train.lr=0.5"]))
    assert error.startswith(f"error: invalid config {project / 'kiln.yaml'}: 'train.epochs'"), error


def test_a_list_of_choices_takes_commas_and_free_text_gets_the_list_form(project: Path) -> None:
    cfg = str(project / "kiln.yaml")
    shown = CliRunner().invoke(main, ["config", cfg, "--set", "precision.variants=fp32,fp16"])
    assert shown.exit_code == 0, shown.output
    assert yaml.safe_load(shown.output)["precision"]["variants"] == ["fp32", "fp16"]
    error, fix = _one_pair(CliRunner().invoke(main, ["config", cfg, "--set", "build.backends=onnxruntime,torch"]))
    assert error.startswith("error: invalid --set build.backends=onnxruntime,torch: "), error
    assert "--set build.backends=[onnxruntime,torch]" in fix, fix


def test_a_set_value_that_is_not_yaml_gets_its_own_fix(project: Path) -> None:
    """Before: fix: see `kiln config --help` for its arguments and options."""
    error, fix = _one_pair(CliRunner().invoke(main, ["config", "--set", "signature.batch_sizes=[1,"]))
    assert "--set signature.batch_sizes=[1," in error and "not valid YAML" in error, error
    assert "--help" not in fix, fix


def test_a_yaml_syntax_error_names_the_place(project: Path) -> None:
    (project / "broken.yaml").write_text("model: [unclosed\n")
    error, fix = _one_pair(CliRunner().invoke(main, ["run", str(project / "broken.yaml"), "-w", str(project / "w")]))
    assert "line 2, column 1" in error and "each key once" not in fix, (error, fix)
