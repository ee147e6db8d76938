"""A forward that fails only while it is exported is named as the user's code: its function and file:line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from kiln.core.errors import ModelError
from kiln.stages.export.stage import export_onnx


class FailsWhenExported(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() or torch.onnx.is_in_onnx_export():
            raise RuntimeError("this model cannot be traced")
        return self.fc(x)


def test_an_export_failure_in_the_users_forward_names_it(tmp_path: Path) -> None:
    model = FailsWhenExported().eval()
    assert model(torch.zeros(2, 4)).shape == (2, 2)  # it runs; only the export fails
    with pytest.raises(ModelError, match=r"cannot be traced \(in forward\(\) at .*test_export_user_code\.py:\d+\)"):
        export_onnx(model, torch.zeros(2, 4), tmp_path / "m.onnx")
