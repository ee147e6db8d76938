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
from kiln.stages.export.torch_export import export_onnx


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
