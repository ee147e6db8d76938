"""`kiln run` without a config in the workdir of a config that sets no `name:`: the refusal names that run by what
tells it apart (its model), not by the default name every such config shares."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kiln.cli import main


def _unnamed_run(workdir: Path, manifests: bool) -> None:
    """A workdir as a config without `name:` leaves it: report.json names the default, `kiln`."""
    workdir.mkdir()
    (workdir / "report.json").write_text(json.dumps({"name": "kiln", "ok": True, "stages": {}}))
    if manifests:
        model = {"name": "mine:build", "params": {}, "checkpoint": None, "onnx": None}
        (workdir / "train").mkdir()
        (workdir / "train" / "manifest.json").write_text(
            json.dumps({"key": "k", "outputs": {}, "key_parts": {"config": {"model": model}}})
        )


@pytest.mark.parametrize(
    ("manifests", "other"), [(True, "another config (model 'mine:build')"), (False, "another config")]
)
def test_the_run_of_a_config_without_a_name_is_named_by_its_model_not_the_default_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, manifests: bool, other: str
) -> None:
    """The refusal said "holds the run of config 'kiln'": the default name, of no config file to find."""
    monkeypatch.chdir(tmp_path)
    _unnamed_run(tmp_path / "out", manifests)
    result = CliRunner().invoke(main, ["validate", "-w", "out", "-q"])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 2, result.output
    assert lines[0] == (
        f"error: workdir out holds the run of {other}; without a config, `kiln validate` runs the built-in demo, "
        "which would replace it"
    )
    assert lines[1] == "fix: give that run's config (`kiln validate CONFIG`), or -w another folder for the demo"
