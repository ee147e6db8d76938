"""A forward that computes the batch as a Python number (Swin's ``B = int(windows.shape[0] / n)``) exports a graph
that holds the traced batch: ONNX Runtime fails at other batch sizes, or answers wrongly there. Both the pipeline's
export and ``kiln export -o`` say so, and where, as one ``error:``/``fix:`` pair (not a traceback, not "raise
export.parity_atol", not a file written as if it passed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner, Result
from torch import nn

from kiln.cli import main
from kiln.core.data import DatasetSplits
from kiln.stages.export.parity import batch_parity, parity
from kiln.stages.export.torch_export import export_onnx
from tests.core.test_ownership import one_error

HERE = "tests.stages.export.test_batch_fixed"
SAID = ("depends on the batch size it was traced at", "(b = int(x.shape[0] / 1))", "// on the shape")


class BatchAsFloat(nn.Module):
    """``b = int(x.shape[0] / 1)``, which the export keeps as the traced batch; ``mix``: softmax over ``b`` rows of
    the batch's values, then back to ``[batch, 3]`` (runs at any batch, right at the traced one only), else a Linear
    on ``b`` rows (ONNX Runtime fails at other batch sizes); ``floor``: ``x.shape[0] // 1``, the fix."""

    def __init__(self, mix: bool = False, floor: bool = False) -> None:
        super().__init__()
        self.fc, self.mix, self.floor = nn.Linear(4, 3), mix, floor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.floor:
            b = x.shape[0] // 1
        else:
            b = int(x.shape[0] / 1)
        if self.mix:
            return self.fc(x).reshape(b, -1).softmax(-1).reshape(-1, 3)
        return self.fc(x.reshape(b, -1))


def ort_fails() -> nn.Module:
    return BatchAsFloat()


def wrong_values() -> nn.Module:
    return BatchAsFloat(mix=True)


def ort_fails_fixed() -> nn.Module:
    return BatchAsFloat(floor=True)


def wrong_values_fixed() -> nn.Module:
    return BatchAsFloat(mix=True, floor=True)


def load() -> DatasetSplits:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 4, generator=g), torch.randint(0, 3, (64,), generator=g)
    return DatasetSplits(x[:48], y[:48], x[48:], y[48:], num_classes=3)


def export(factory: str, out: Path) -> Result:
    return CliRunner().invoke(main, ["export", "--model", f"{HERE}:{factory}", "--input-shape", "4", "-o", str(out)])


@pytest.mark.parametrize("factory", ["ort_fails", "wrong_values"])
def test_direct_export_refuses_a_graph_that_holds_the_traced_batch(tmp_path: Path, factory: str) -> None:
    """Before: parity ran on the two traced rows only, and the broken file was written as passing."""
    out = tmp_path / "m.onnx"
    result = export(factory, out)
    one_error(result, *SAID, "forward() at ")
    assert "parity_atol" not in result.output and not out.exists()
    fixed = export(f"{factory}_fixed", out)
    assert fixed.exit_code == 0 and out.exists(), fixed.output  # the fix line's advice exports


@pytest.mark.parametrize("factory", ["ort_fails", "wrong_values"])
def test_the_pipeline_export_says_the_graph_holds_the_traced_batch(tmp_path: Path, factory: str) -> None:
    """Before: ONNX Runtime's traceback (exit 1), or a fix line saying to raise export.parity_atol."""
    cfg = {
        "model": {"name": f"{HERE}:{factory}"},
        "data": {"name": f"{HERE}:load"},
        "train": {"epochs": 1, "batch_size": 16},
        "signature": {"batch_sizes": [1, 8]},
    }
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    result = CliRunner().invoke(main, ["run", str(path), "-w", str(tmp_path / "wd"), "--until", "export"])
    one_error(result, *SAID)
    assert "parity_atol" not in result.output


def test_an_error_at_every_batch_is_left_to_the_tolerance(tmp_path: Path) -> None:
    """A graph off at the traced batch too is not batch-dependent: the check comes back, held to
    export.parity_atol by the caller (here the graph of other weights than the model's)."""
    x = load().val_x[:8]
    export_onnx(ort_fails_fixed().eval(), x[:2], tmp_path / "m.onnx")
    check = batch_parity(ort_fails_fixed().eval(), tmp_path / "m.onnx", x[:2], x, atol=1e-4)
    assert check["samples"] == 8 and check["max_abs_err"] > 1e-2


def test_an_inexact_graph_missing_the_tolerance_is_not_blamed_on_the_batch(tmp_path: Path) -> None:
    """A plain MLP whose error on 8 rows exceeds the tolerance while its 2 traced rows meet it: those rows come out
    the same within the 8, so the graph does not hold its batch and the check goes back to the caller."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)).eval()
    x = torch.randn(8, 64) * 10
    path = tmp_path / "m.onnx"
    export_onnx(model, x[:2], path)
    worst, traced = parity(model, path, x)["max_abs_err"], parity(model, path, x[:2])["max_abs_err"]
    if not traced < worst:
        pytest.skip(f"this CPU's kernels give the traced rows the largest error ({traced:.3g} >= {worst:.3g})")
    check = batch_parity(model, path, x[:2], x, atol=(traced + worst) / 2)
    assert check["samples"] == 8 and check["max_abs_err"] == worst
