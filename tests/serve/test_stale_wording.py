"""`kiln serve WORKDIR` refusing a package kept from an earlier run: it names the stages a later run redid, as a
list ("build, train and validate"), and not a stage that has not run since the package was made; where no stage ran
since, it says the files differ, not that a run redid them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kiln.core.errors import GateFailure
from kiln.pipeline.api import run_pipeline
from kiln.pipeline.config import config_from_dict
from kiln.serve.server import find_engines
from tests.conftest import tiny_config_dict

pytestmark = pytest.mark.slow  # pipeline runs end to end

FAILING = {"validate.gates.max_latency_p50_ms": 1e-9}  # a gate no engine passes: the package stage does not run


@pytest.fixture(scope="module")
def packaged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A workdir whose run passed and packaged its engines."""
    workdir = tmp_path_factory.mktemp("packaged") / "run"
    result, _ = run_pipeline(config_from_dict(tiny_config_dict()), workdir)
    assert result.ok, result.error
    return workdir


def _refusal(workdir: Path) -> str:
    with pytest.raises(GateFailure) as refused:
        find_engines(workdir)
    return refused.value.message


def test_the_stages_a_later_run_redid_are_listed_a_b_and_c(packaged: Path, tmp_path: Path) -> None:
    """Another seed retrains: train, build and validate all differ from the package's, read as one list."""
    workdir = tmp_path / "run"
    shutil.copytree(packaged, workdir)
    result, _ = run_pipeline(config_from_dict(tiny_config_dict(seed=7, **FAILING)), workdir)
    assert not result.ok
    assert ": build, train and validate changed since it was made (a later run redid them" in _refusal(workdir)


def test_a_stage_that_has_not_run_since_the_package_was_made_is_not_said_to_have_changed(
    packaged: Path, tmp_path: Path
) -> None:
    """Only validate reran (train cached): train is not named, though its hash reads otherwise than the package's
    record of it (a record hashed another way)."""
    workdir = tmp_path / "run"
    shutil.copytree(packaged, workdir)
    result, _ = run_pipeline(config_from_dict(tiny_config_dict(**FAILING)), workdir)
    assert not result.ok and {r.name: r.status for r in result.records}["train"] == "cached"
    manifest = workdir / "package" / "manifest.json"
    record = json.loads(manifest.read_text())
    record["key_parts"]["inputs"]["train"] = "0" * 64
    manifest.write_text(json.dumps(record))
    said = _refusal(workdir)
    assert ": validate changed since it was made (a later run redid it" in said and "train" not in said


@pytest.mark.parametrize("dated", [False, True])
def test_files_changed_by_no_run_are_not_said_to_be_redone(packaged: Path, tmp_path: Path, dated: bool) -> None:
    """No stage ran after the package, yet validate's record differs from the package's: the refusal said a later
    run redid it and failed, which no run did. ``dated``: validate a day before the package; else as the run left
    them (often the same second)."""
    workdir = tmp_path / "run"
    shutil.copytree(packaged, workdir)
    for stage, day in (("validate", "01"), ("package", "02")) if dated else ():
        stamped = json.loads((workdir / stage / "manifest.json").read_text())
        stamped["finished"] = f"2026-01-{day}T00:00:00+00:00"
        (workdir / stage / "manifest.json").write_text(json.dumps(stamped))
    manifest = workdir / "package" / "manifest.json"
    record = json.loads(manifest.read_text())
    record["key_parts"]["inputs"]["validate"] = "0" * 64
    manifest.write_text(json.dumps(record))
    said = _refusal(workdir)
    assert "the files of validate differ from those packaged" in said and "a later run" not in said, said
