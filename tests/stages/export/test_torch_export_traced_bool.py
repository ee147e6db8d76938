"""A Python branch on a tensor's truth value that the TorchScript exporter traces: refused as the dynamo exporter's
failure on it is, at every opset, and without the hint to skip the dynamo exporter."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn

from kiln.core.errors import ModelError
from kiln.stages.export.torch_export import export_onnx


class Branches(nn.Module):
    """Doubles its input where the batch's sum is positive."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # BRANCH
            return x * 2
        return x


class Asserts(nn.Module):
    """Checks its input's values: the graph leaves the check out and computes the same for every input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert (x > -100).all()
        return x * 2


class ShapeBranches(nn.Module):
    """Branches on its input's length and on a weight's value: the trace warns of both (its sizes are tensors), and
    the graph computes both for every input."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("on", torch.tensor(True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] > 2 and self.on:
            return x * 2
        return x


def _branch_line() -> int:
    return next(i for i, line in enumerate(Path(__file__).read_text().splitlines(), 1) if line.endswith("# BRANCH"))


def test_a_branch_the_torchscript_exporter_traced_at_opset_17_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelError) as err:
        export_onnx(Branches().eval(), torch.ones(2, 4), tmp_path / "m.onnx", opset=17)
    where = f"test_torch_export_traced_bool.py:{_branch_line()}"
    assert f"decides a branch from its inputs' values at {where}" in err.value.message
    assert "torch.where" in (err.value.hint or "") and "export.opset 18" in (err.value.hint or "")


def test_a_refused_branch_gets_no_hint_to_skip_the_dynamo_exporter(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kiln.export"), pytest.raises(ModelError, match="decides a branch"):
        export_onnx(Branches().eval(), torch.ones(2, 4), tmp_path / "m.onnx")
    assert "export.opset: 17" not in caplog.text


def test_an_assert_on_the_values_is_not_a_branch(tmp_path: Path) -> None:
    export_onnx(Asserts().eval(), torch.ones(2, 4), tmp_path / "m.onnx", opset=17)


def test_a_branch_on_the_inputs_shape_or_a_weight_is_not_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kiln.export"):
        export_onnx(ShapeBranches().eval(), torch.ones(2, 4), tmp_path / "m.onnx", opset=17)
    assert "fixed values the model's Python code reads from tensors at test_torch_export_traced_bool.py:" in caplog.text
