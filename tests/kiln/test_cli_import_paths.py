"""Where a config's import paths (``model.name: mymodels:build``) resolve from: the config's folder first, then the
folder kiln runs in; and a project file named like a package Kiln imports is refused, not imported in its place."""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from kiln.cli import main


@pytest.fixture(autouse=True)
def own_sys_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))  # the command puts the folders first: undone after each test


def _project(folder: Path, module: str, text: str = "def build():\n    return None\n") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{module}.py").write_text(text)
    config = folder / "kiln.yaml"
    config.write_text(yaml.safe_dump({"model": {"name": f"{module}:build"}}))
    return config


def test_the_configs_folder_comes_before_the_folder_kiln_runs_in_and_a_module_in_both_is_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Run from another project holding a module of the same name, the config's own module is the one imported."""
    config = _project(tmp_path / "paper", "kiln_probe_models")
    _project(tmp_path / "other", "kiln_probe_models")
    monkeypatch.chdir(tmp_path / "other")
    with caplog.at_level(logging.WARNING, logger="kiln"):
        result = CliRunner().invoke(main, ["config", "-c", str(config)])
    assert result.exit_code == 0, result.output
    spec = importlib.util.find_spec("kiln_probe_models")
    assert spec is not None and Path(spec.origin).parent == tmp_path / "paper"
    said = caplog.text
    assert f"kiln_probe_models is in both {tmp_path / 'paper'} (the config's folder: used) and" in said


@pytest.mark.parametrize("name", ["onnx.py", "numpy/__init__.py", "statistics.py", "queue.py"])
def test_a_project_file_named_like_a_package_kiln_imports_is_refused(tmp_path: Path, name: str) -> None:
    """A project's export script `onnx.py` next to its config was imported in place of onnx (a traceback)."""
    config = _project(tmp_path / "proj", "kiln_probe_net")
    (tmp_path / "proj" / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / "proj" / name).write_text("print('not the library')\n")
    result = CliRunner().invoke(main, ["config", "-c", str(config)])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 2, result.output
    shown = tmp_path / "proj" / name.removesuffix("/__init__.py")
    assert lines[0].startswith(
        f"error: {shown} would be imported in place of the {Path(name).parts[0].removesuffix('.py')} module"
    )
    assert lines[1] == f"fix: rename {shown.name} (and the imports of it in your code)"


@pytest.mark.parametrize("command", ["run", "validate"])
def test_no_config_in_a_workdir_of_another_run_is_refused_and_the_run_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    """`kiln run` without its config, in a project folder: the demo replaced the project's run (its weights too)."""
    import json

    monkeypatch.chdir(tmp_path)
    (tmp_path / "kiln.yaml").write_text("name: mine\n")
    weights = tmp_path / "kiln-out" / "train" / "model.safetensors"
    weights.parent.mkdir(parents=True)
    weights.write_bytes(b"trained")
    (tmp_path / "kiln-out" / "report.json").write_text(json.dumps({"name": "mine", "ok": True, "stages": {}}))
    result = CliRunner().invoke(main, [command, "-q"])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 2, result.output
    assert lines[0] == (
        f"error: workdir kiln-out holds the run of config 'mine'; without a config, `kiln {command}` runs the "
        "built-in demo, which would replace it"
    )
    assert lines[1] == f"fix: give that run's config (`kiln {command} kiln.yaml`), or -w another folder for the demo"
    assert weights.read_bytes() == b"trained"


def test_kiln_under_torchrun_is_refused_naming_both_ways_to_train_on_several_processes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`torchrun -m kiln.cli train`: both ranks ran the whole command into one workdir and collided."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    result = CliRunner().invoke(main, ["train", "-w", str(tmp_path / "w"), "-q"])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 2, result.output
    assert lines[0].startswith("error: kiln was started by torchrun (WORLD_SIZE=2)")
    assert "train.distributed.nproc_per_node" in lines[1] and "kiln.stages.train.worker" in lines[1]
    assert not (tmp_path / "w").exists()


def test_a_project_s_test_py_a_yaml_folder_and_a_namespace_folder_are_no_library(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Python's `test` package is never imported by Kiln; a folder without __init__.py (configs/models/ of YAML
    files, Hydra-style) is neither a library's stand-in nor the module `models` Python imports."""
    config = _project(tmp_path / "proj" / "configs", "kiln_probe_unused")
    config.write_text(yaml.safe_dump({"model": {"name": "models:build"}}))
    (tmp_path / "proj" / "configs" / "models").mkdir()
    (tmp_path / "proj" / "models").mkdir()
    (tmp_path / "proj" / "models" / "__init__.py").write_text("def build():\n    return None\n")
    (tmp_path / "proj" / "test.py").write_text("")
    (tmp_path / "proj" / "json").mkdir()  # a data folder named like a module, without __init__.py
    monkeypatch.chdir(tmp_path / "proj")
    with caplog.at_level(logging.WARNING, logger="kiln"):
        result = CliRunner().invoke(main, ["config", "-c", str(config)])
    assert result.exit_code == 0, result.output
    assert "is in both" not in caplog.text


def test_a_run_stopped_before_its_report_is_kept_from_the_demo_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An interrupted run has stage manifests but no report.json: the demo replaced its trained weights."""
    import json

    monkeypatch.chdir(tmp_path)
    manifest = tmp_path / "kiln-out" / "train" / "manifest.json"
    manifest.parent.mkdir(parents=True)
    model = {"name": "net:build", "params": {}, "checkpoint": None, "onnx": None}
    manifest.write_text(json.dumps({"key": "k", "outputs": {}, "key_parts": {"config": {"model": model}}}))
    result = CliRunner().invoke(main, ["run", "-q"])
    assert result.exit_code == 2, result.output
    assert "holds the run of model 'net:build'; without a config" in result.output
