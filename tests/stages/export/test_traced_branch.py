"""A Python branch on the inputs' values: the dynamo exporter refuses it, and the TorchScript fallback must not
pass off the one branch its trace took as the model."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from kiln.core.errors import ModelError
from kiln.stages.export.torch_export import export_onnx


class Branches(nn.Module):
    """Takes one head or the other by the sign of the batch's sum."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum().item() > 0:
            return self.a(x)
        return self.b(x)


class ReshapesThenBranches(nn.Module):
    """A shape read as a Python number (the trace warns of it too), then the branch on the values."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        side = int(math.sqrt(x.shape[1]))  # SHAPE LINE
        x = x.reshape(x.shape[0], side * side)
        if x.sum().item() > 0:  # BRANCH LINE
            return self.a(x)
        return self.b(x)


class ReadsAConstant(nn.Module):
    """Reads a buffer's value in Python: the trace keeps it, which is right."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * float(self.scale)


def test_a_branch_on_the_inputs_values_is_refused_naming_its_line(tmp_path: Path) -> None:
    example = torch.ones(3, 4)  # every row takes branch a; the graph would compute a for any input
    with pytest.raises(ModelError, match=r"decides a branch from its inputs' values at test_traced_branch\.py:\d+"):
        export_onnx(Branches().eval(), example, tmp_path / "m.onnx")


def test_a_traced_constant_is_said_not_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Opset 17 goes to the TorchScript exporter directly: a value read in Python is logged with its place."""
    with caplog.at_level(logging.WARNING, logger="kiln.export"):
        export_onnx(ReadsAConstant().eval(), torch.ones(3, 4), tmp_path / "m.onnx", opset=17)
    assert "fixed values the model's Python code reads from tensors at test_traced_branch.py:" in caplog.text


def test_the_refusal_names_the_branch_dynamo_named_not_the_shape_reads(tmp_path: Path) -> None:
    lines = Path(__file__).read_text().splitlines()
    branch = next(i for i, line in enumerate(lines, 1) if line.endswith("# BRANCH LINE"))
    with pytest.raises(ModelError) as err:
        export_onnx(ReshapesThenBranches().eval(), torch.ones(3, 4), tmp_path / "m.onnx")
    assert f"from its inputs' values at test_traced_branch.py:{branch} (" in err.value.message


class ForecastsADistribution(nn.Module):
    """A forecaster returning its Normal's mean (as HF's TimeSeriesTransformer builds one per step), after a shape read
    the trace warns of: torch.distributions checks the Normal's scale is positive (validate_args), a branch on the
    values the dynamo exporter stops at, inside torch."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 2)
        self.distribution = lambda h: torch.distributions.Normal(h[:, 0], nn.functional.softplus(h[:, 1]))  # BUILT

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        side = int(math.sqrt(x.shape[1]))
        return self.distribution(self.head(x.reshape(x.shape[0], side * side))).mean


def test_a_branch_in_distribution_argument_checks_is_named_with_the_switch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.distributions.Distribution, "_validate_args", True)  # Python's default (__debug__)
    with pytest.raises(ModelError) as err:
        export_onnx(ForecastsADistribution().eval(), torch.ones(3, 4), tmp_path / "m.onnx")
    built = next(i for i, line in enumerate(Path(__file__).read_text().splitlines(), 1) if line.endswith("# BUILT"))
    assert "inside torch.distributions, at distribution.py:" in err.value.message
    assert f"(the distribution built at test_traced_branch.py:{built})" in err.value.message
    assert "validate_args" in err.value.message
    assert "torch.distributions.Distribution.set_default_validate_args(False)" in (err.value.hint or "")
