"""report.md on a variant whose graph was not made: the torch backend's engines, compiled from the PyTorch model,
are said to be built still only in a run that has a PyTorch model (a run from model.onnx has none)."""

from __future__ import annotations

import pytest

from kiln.pipeline.report import render_markdown
from tests.stages.precision.test_report import _report

WHY = "int8 not made: 0% of its FLOPs run in int8 (5 nodes kept in float to pass the gates)"


@pytest.mark.parametrize("pytorch_model", [False, True])
def test_the_torch_backends_engines_are_said_only_with_a_pytorch_model(pytorch_model: bool) -> None:
    int8 = {"kept_fp32": 5, "unmade": WHY, **({"pytorch_model": True} if pytorch_model else {})}
    md = render_markdown(_report({"variants": {"fp32": {"kept_fp32": 0}, "int8": int8}}))
    assert f"- **int8**: {WHY}; no engine is built from its graph" in md
    assert ("torch backend" in md) == pytorch_model, md
