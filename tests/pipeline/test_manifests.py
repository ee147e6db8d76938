"""A workdir's stage folders against the runs that wrote them."""

from __future__ import annotations

import json
import os
from pathlib import Path

from kiln.pipeline.manifests import failed_since


def test_a_failed_run_after_a_stage_wrote_its_folder_is_found(tmp_path: Path) -> None:
    """`kiln serve` on a workdir whose last run failed at export with other settings: the package is the run
    before's, which that run did not reach (its inputs unchanged, as the failed export kept the old folder)."""
    (tmp_path / "package").mkdir()
    (tmp_path / "package" / "manifest.json").write_text("{}")
    report = tmp_path / "report.json"
    assert failed_since(tmp_path, "package") is None  # no run since
    report.write_text(json.dumps({"ok": False, "error": "the exported graph does not compute the model\n  fix: x"}))
    os.utime(report, (1e10, 1e10))
    assert failed_since(tmp_path, "package") == "the exported graph does not compute the model"
    report.write_text(json.dumps({"ok": True}))
    os.utime(report, (1e10, 1e10))
    assert failed_since(tmp_path, "package") is None  # the last run passed
    report.write_text(json.dumps({"ok": False, "error": "e"}))
    os.utime(report, (1.0, 1.0))
    assert failed_since(tmp_path, "package") is None  # a failure before the package was written
