"""report.md and the log on a variant whose graph was not made: the torch backend's engines, compiled from the
PyTorch model, are said to be built still only in a run that has a PyTorch model (a run from model.onnx has none);
ONNX Runtime CPU engines are said to load the Q/DQ graph only where that graph passed."""

from __future__ import annotations

import logging

import pytest

from kiln.pipeline.report import render_markdown
from kiln.stages.precision.stage import _log_variant
from tests.stages.precision.test_report import _report

WHY = "int8 not made: 0% of its FLOPs run in int8 (5 nodes kept in float to pass the gates)"


@pytest.mark.parametrize("pytorch_model", [False, True])
def test_the_torch_backends_engines_are_said_only_with_a_pytorch_model(pytorch_model: bool) -> None:
    int8 = {"kept_fp32": 5, "unmade": WHY, **({"pytorch_model": True} if pytorch_model else {})}
    md = render_markdown(_report({"variants": {"fp32": {"kept_fp32": 0}, "int8": int8}}))
    assert f"- **int8**: {WHY}; no engine is built from its graph" in md
    assert ("torch backend" in md) == pytorch_model, md


CPU_WHY = "int8 (onnxruntime-cpu graph) not made: 41% of its FLOPs run in int8 (12 nodes kept in float)"


def test_an_ort_cpu_graph_dropped_beside_a_failed_qdq_graph_leaves_no_int8_cpu_engine() -> None:
    """Both graphs missed: the report says no ONNX Runtime CPU engine is built in int8, not that it loads the Q/DQ
    graph instead."""
    int8 = {"kept_fp32": 5, "unmade": WHY, "ort_cpu_unmade": CPU_WHY, "ort_cpu_scheme": "static"}
    md = render_markdown(_report({"variants": {"fp32": {"kept_fp32": 0}, "int8": {**int8, "fallback_passed": False}}}))
    assert f"`int8`: {CPU_WHY}; its Q/DQ graph missed its gates too, so no ONNX Runtime CPU engine is built" in md
    assert "load the Q/DQ graph instead" not in md


def test_a_qdq_graph_that_passed_its_gates_is_not_said_to_have_missed_them() -> None:
    """A Q/DQ graph not made for too little in int8 (calibration.exclude_op_types kept its convolutions) passed
    every gate: the report says it was not made, not that it missed its gates."""
    excluded = "int8 not made: 0% of its FLOPs run in int8 (3 nodes excluded by calibration.exclude_op_types)"
    int8 = {"kept_fp32": 3, "unmade": excluded, "ort_cpu_unmade": CPU_WHY, "fallback_passed": True}
    md = render_markdown(_report({"variants": {"fp32": {"kept_fp32": 0}, "int8": int8}}))
    assert f"`int8`: {CPU_WHY}; its Q/DQ graph was not made either, so no ONNX Runtime CPU engine is built" in md
    assert "gates too" not in md


def test_the_stages_log_says_the_same(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("kiln.precision")
    with caplog.at_level(logging.WARNING, logger="kiln.precision"):
        _log_variant(
            log,
            "int8",
            {
                **{"kept_fp32": [], "path": "int8/model.onnx", "unmade": WHY, "ort_cpu_unmade": CPU_WHY},
                "fallback": {"passed": False},
            },
        )
        _log_variant(log, "fp8", {"kept_fp32": [], "path": "fp8/model.onnx", "ort_cpu_unmade": CPU_WHY})
    said = [r.getMessage() for r in caplog.records]
    assert f"{CPU_WHY}; its Q/DQ graph missed its gates too, so no ONNX Runtime CPU engine is built in this " in said[1]
    assert "instead" not in said[1] and said[2] == f"{CPU_WHY}; ONNX Runtime CPU engines load the Q/DQ graph instead"
