"""``kiln export -o`` names output axes as the pipeline's export does (:func:`kiln.stages.export.output_axes.
name_output_axes`): a time-major output the TorchScript exporter (opset 17) declares ``[batch, batch, C]`` gets the
axis its steps follow."""

from __future__ import annotations

from pathlib import Path

import onnx
import torch
from torch import nn

from kiln.pipeline.config import load_config
from kiln.pipeline.runner import settings_for
from kiln.pipeline.stage_list import stage_named
from kiln.stages.export.stage import export_direct


class TimeMajor(nn.Module):
    """x [N, width, 3] -> a Linear, then time-major [width, N, 2] (a CRNN's log-probabilities)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).transpose(0, 1)


def time_major() -> TimeMajor:
    return TimeMajor()


def _dims(path: Path) -> list[str | int]:
    out = onnx.load(str(path)).graph.output[0].type.tensor_type.shape.dim
    return [d.dim_param or d.dim_value for d in out]


def test_a_direct_export_names_the_axis_a_time_major_output_follows(tmp_path: Path) -> None:
    model = f"{__name__}:time_major"
    sets = {"model.name": model, "data.name": None, "export.opset": 17, "signature.dynamic_axes": {"x": {1: "width"}}}
    cfg = settings_for(stage_named("export"), load_config(None, sets))
    summary = export_direct(cfg, None, ("x=6x3",), tmp_path / "m.onnx")
    assert _dims(tmp_path / "m.onnx") == ["width", "batch", 2], _dims(tmp_path / "m.onnx")
    assert summary["output_axes"] == {"logits": {0: "width"}}, summary["output_axes"]
