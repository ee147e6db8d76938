"""report.md's metric line judges validate.metric in the direction its gate did (validate.metric_higher_is_better)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import numpy as np
import pytest

from kiln.core.records import Baseline, EngineValidation, ValidationResult
from kiln.pipeline.config import config_from_dict
from kiln.pipeline.report import build_report, render_markdown
from kiln.pipeline.runner import RunResult, StageRecord
from tests.conftest import tiny_config_dict


def test_a_metric_set_lower_is_better_is_reported_as_its_gate_judged_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error metric of the user's with no attributes, set lower-is-better in the config: its gate passed an
    engine whose error fell, and report.md said "drop 0.0005851 ... (higher is better)", the opposite."""
    module = types.ModuleType("kiln_test_direction")
    module.err = lambda outputs, labels: float(np.mean(outputs["logits"]))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kiln_test_direction", module)
    engine = EngineValidation(
        name="e-int8", backend="b", precision="int8", device="cpu", status="validated", passed=True, metric=0.6709
    )
    engine.gates = {"max_metric_drop": 0.0001}
    baseline = Baseline(accuracy=None, samples=8, latency_ms={}, metric=0.6715, metric_name="kiln_test_direction:err")
    validation = ValidationResult(passed=True, baseline=baseline, engines=[engine], failures=[])
    cfg = config_from_dict(
        tiny_config_dict(**{"validate.metric": "kiln_test_direction:err", "validate.metric_higher_is_better": False}),
        source=str(tmp_path / "kiln.yaml"),
    )
    report = build_report(RunResult(tmp_path / "wd", [StageRecord("validate", "ran", 0.1, summary=validation)]), cfg)
    line = next(x for x in render_markdown(report).splitlines() if x.startswith("Metric `kiln_test_direction:err`"))
    assert "e-int8 0.6709 (rise -0.0006, gate ≤ 0.0001)" in line, line
    assert "(lower is better)" in line and "higher is better" not in line, line
