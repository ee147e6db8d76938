"""A forward that fails only while it is exported is named as the user's code: its function and file:line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from kiln.core.errors import ModelError
from kiln.stages.export.torch_export import export_onnx


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


def test_a_ctrl_c_that_comes_out_of_the_exporter_as_another_error_stops_the_export(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C landing in the exporter's imports came out as an AttributeError: the export fell back to the
    TorchScript exporter and the command ended 0. The handler saw it, so the export stops."""
    from kiln.core import interrupt
    from kiln.stages.export import torch_export

    def interrupted(*args: object, **kwargs: object) -> None:
        interrupt._seen.set()  # as the SIGINT handler records it
        raise AttributeError("module 'torch._dynamo' has no attribute 'exc'")

    monkeypatch.setattr(torch_export, "_export", interrupted)
    try:
        with pytest.raises(KeyboardInterrupt):
            export_onnx(nn.Linear(4, 2).eval(), torch.zeros(2, 4), tmp_path / "m.onnx")
    finally:
        interrupt._seen.clear()


class FailsUnderDynamo(nn.Module):
    """A forward the dynamo exporter fails on and the TorchScript exporter takes."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_exporting():
            raise RuntimeError("not while torch.export traces (it refuses)")
        return self.fc(x)


def test_the_fallback_warning_quotes_the_dynamo_error_once_without_doubled_parentheses(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The reason, which ends with its own parenthesis (where in the user's code), was put in another pair."""
    with caplog.at_level("WARNING", logger="kiln"):
        export_onnx(FailsUnderDynamo().eval(), torch.zeros(2, 4), tmp_path / "m.onnx")
    said = [r.getMessage() for r in caplog.records if "dynamo exporter failed" in r.getMessage()]
    assert len(said) == 1 and "(it refuses) (in forward() at" in said[0], said
    assert "))" not in said[0], said[0]
