"""The dynamic axes are checked at sizes other than the export's: by ``kiln export -o`` as by the pipeline, a size
where the model's own output holds no finite value is refused, a Python loop over an axis is named as what fixed
it, and a listed size off the steps a U-Net takes sizes in is said as that."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from kiln.cli import main
from kiln.core.data import DatasetSplits
from kiln.core.errors import ModelError
from kiln.core.onnx_io import ort_session
from kiln.stages.export.stage import check_validated_sizes, export_onnx
from tests.core.test_ownership import one_error

HERE = "tests.stages.export.test_sizes_checked"


class LoopScan(nn.Module):
    """A recurrence over time as a Python loop: both exporters unroll it to the example's length."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(4, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = self.emb(x)
        h, ys = torch.zeros_like(u[:, 0]), []
        for t in range(x.shape[1]):  # the line the error names
            h = 0.5 * h + u[:, t]
            ys.append(h)
        return self.head(torch.stack(ys, 1).mean(1))


class CumsumScan(LoopScan):
    """The same recurrence's shape as tensor ops over the whole axis: exports with the axis dynamic."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cumsum(self.emb(x), 1).mean(1))


def loop() -> nn.Module:
    return LoopScan()


def cumsum() -> nn.Module:
    return CumsumScan()


def _export(factory: str, out: Path, *sets: str):
    args = ["export", "--model", f"{HERE}:{factory}", "--input-shape", "input=12:int64", "-o", str(out)]
    sets = ("signature.dynamic_axes={input: {1: seq}}", *sets)
    return CliRunner().invoke(main, [*args, *(a for s in sets for a in ("--set", s))])


def test_direct_export_refuses_a_loop_the_exporter_unrolled_at_the_example_length(tmp_path: Path) -> None:
    """Before: the graph, declared [batch, seq] and unrolled to 12 steps, was written (exit 0); ONNX Runtime then
    failed at any other length."""
    out = tmp_path / "m.onnx"
    result = _export("loop", out)
    one_error(result, "does not compute the model at seq=6", "test_sizes_checked.py:34", "Python loop")
    assert not out.exists()
    fine = _export("cumsum", out)
    assert fine.exit_code == 0 and out.exists(), fine.output


def test_direct_export_checks_the_sizes_signature_shapes_lists(tmp_path: Path) -> None:
    out = tmp_path / "m.onnx"
    one_error(_export("loop", out, "signature.shapes={seq: [12, 20]}"), "does not compute the model at seq=20")
    assert not out.exists()


def _checked(tmp_path: Path, model: nn.Module, x: torch.Tensor, axes: dict, shapes: dict) -> None:
    """The pipeline's check of the sizes the later stages run, on a graph exported from ``x``'s first two rows."""
    data, path = DatasetSplits(x[:8], None, x[8:], None), tmp_path / "m.onnx"
    export_onnx(model.eval(), x[:2], path, dynamic_axes=axes)
    check_validated_sizes(model, path, ort_session(path), data, ["input"], axes, shapes, 1e-4, 1e-5)


def test_the_pipeline_names_the_loop_that_fixed_the_length(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match=r"seq=6.*in forward\(\) at .*test_sizes_checked.py:34 \(for t in") as err:
        _checked(tmp_path, LoopScan(), torch.randint(0, 4, (12, 12)), {"input": {1: "seq"}}, {})
    assert "a Python loop over a dynamic axis" in (err.value.hint or "")


class Overflows(nn.Module):
    """``exp`` of a sum that grows with the length: finite at 8 tokens (e^40), infinite from 18 (e^90) in float32."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(4, 1)
        nn.init.ones_(self.emb.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(5 * torch.cumsum(self.emb(x), 1)).mean(1)


def test_a_size_where_the_models_output_is_nowhere_finite_is_refused(tmp_path: Path) -> None:
    """Before: NaN and infinity compared as equal to the graph's, and seq=24 was recorded as validated."""
    x, axes = torch.randint(0, 4, (12, 8)), {"input": {1: "seq"}}
    with pytest.raises(ModelError, match=r"output 'logits' is NaN or infinite at every value at seq=24") as err:
        _checked(tmp_path, Overflows(), x, axes, {"seq": [4, 24]})
    assert "signature.shapes: {seq: [4, 8]}" in (err.value.hint or "")
    _checked(tmp_path, Overflows(), x, axes, {"seq": [4, 16]})  # finite there


class MaskedSpans(nn.Module):
    """Span logits with -inf at the positions a mask leaves out (a QA head): finite at the others."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.emb(x)[..., 0].masked_fill(x == 0, float("-inf"))


def test_an_output_infinite_at_some_positions_only_is_compared_as_usual(tmp_path: Path) -> None:
    x = torch.randint(0, 4, (12, 8))
    x[:, ::2] = 0
    _checked(tmp_path, MaskedSpans(), x, {"input": {1: "seq"}}, {"seq": [4, 16]})


class TinyUNet(nn.Module):
    """Pooling, a transposed convolution and a skip connection: an odd height or width cannot meet its skip."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.down = nn.Conv2d(1, 4, 3, padding=1), nn.Sequential(nn.MaxPool2d(2), nn.Conv2d(4, 4, 1))
        self.up, self.head = nn.ConvTranspose2d(4, 4, 2, stride=2), nn.Conv2d(8, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.enc(x)
        return self.head(torch.cat([e, self.up(self.down(e))], dim=1))


def test_a_listed_size_off_the_models_steps_is_said_as_that(tmp_path: Path) -> None:
    """Before: the fix said to give h and w one name, spoke of a sequence's end token and to validate at 16 only."""
    axes = {"input": {2: "h", 3: "w"}}
    with pytest.raises(ModelError, match="the model fails at h=9, w=10") as err:
        _checked(tmp_path, TinyUNet(), torch.rand(12, 1, 16, 16), axes, {"h": [9, 16], "w": [10, 16]})
    assert err.value.hint == (
        "h=9 is not a size the model takes: it takes h in steps of 2 (8, 10, ...): list such sizes in signature.shapes"
    )
    _checked(tmp_path, TinyUNet(), torch.rand(12, 1, 16, 16), axes, {"h": [8, 16], "w": [10, 16]})
