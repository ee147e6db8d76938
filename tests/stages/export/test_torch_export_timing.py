"""The dynamo exporter may trace for minutes before it fails: its start is logged, and its failure says how long it
took, so a slow export is seen to spend its time there."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from kiln.core.errors import ModelError
from kiln.stages.export.torch_export import export_onnx, export_with_fallback


class Branches(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x * 2
        return x


def test_the_dynamo_exporter_is_said_to_start_and_its_failure_says_its_seconds(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kiln.export")
    with pytest.raises(ModelError):
        export_onnx(Branches().eval(), torch.rand(2, 4), tmp_path / "m.onnx")
    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "kiln.export"]
    assert (logging.INFO, "export: dynamo exporter running (torch.onnx.export)") in said
    failed = [m for level, m in said if level == logging.WARNING and m.startswith("dynamo exporter failed: ")]
    assert failed and re.search(r" \(\d+\.\d s\); trying the TorchScript exporter$", failed[0]), failed


def test_a_graph_the_torchscript_exporter_made_after_dynamo_failed_says_how_to_skip_dynamo(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The dynamo exporter fixes Guidance's batch and the TorchScript exporter exports it: the log says its failed
    attempt's seconds and that ``export.opset: 17`` goes to the TorchScript exporter directly."""
    from tests.stages.export.test_torch_export import Guidance

    example = {"x": torch.randn(2, 4), "y": torch.zeros(2, dtype=torch.long)}
    with caplog.at_level(logging.WARNING, logger="kiln.export"):
        _, refused = export_with_fallback(Guidance().eval(), example, tmp_path / "m.onnx")
    assert refused, "the dynamo exporter exported Guidance: the test needs a model it fails on"
    said = [r.getMessage() for r in caplog.records if r.name == "kiln.export" and r.levelno == logging.WARNING]
    line = (
        r"the TorchScript exporter exported the graph \(\d+\.\d s\) after the dynamo exporter's failed attempt "
        r"\((\d+\.\d) s\)"
    )
    skip = r": export.opset: 17 exports with the TorchScript exporter directly, skipping those \1 s$"
    assert any(re.fullmatch(line + skip, m) for m in said), said
