"""report.json and report.md: what the run was validated on."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.core.records import Baseline, ValidationResult
from kiln.pipeline.config import config_from_dict
from kiln.pipeline.report import build_report, render_markdown
from kiln.pipeline.runner import RunResult, StageRecord
from tests.conftest import tiny_config_dict

VALIDATION = ValidationResult(
    passed=True, baseline=Baseline(accuracy=None, samples=4, latency_ms={}), engines=[], failures=[]
)


@pytest.mark.parametrize(
    "sections,random",
    [
        ({"model": {"onnx": "m.onnx"}}, True),  # an ONNX file and no data: random_splits
        ({"model": {"onnx": "m.onnx"}, "data": {"name": "digits"}}, False),
        ({"model": {"onnx": "m.onnx", "name": "cnn"}}, False),  # a PyTorch model: its default dataset
        ({"model": {"name": "cnn"}}, False),
    ],
    ids=["onnx-no-data", "onnx-digits", "onnx-and-model", "model"],
)
def test_a_run_on_random_inputs_says_so_in_its_report(tmp_path: Path, sections: dict, random: bool) -> None:
    (tmp_path / "m.onnx").write_bytes(b"")
    cfg = config_from_dict({**tiny_config_dict(), **sections}, source=str(tmp_path / "kiln.yaml"))
    result = RunResult(tmp_path / "wd", [StageRecord("validate", "ran", 0.1, summary=VALIDATION)])
    report = build_report(result, cfg)
    assert (report.get("inputs", {}).get("kind") == "random") is random
    assert ("**Inputs: RANDOM arrays" in render_markdown(report)) is random
