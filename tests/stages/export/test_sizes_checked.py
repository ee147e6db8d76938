"""The dynamic axes are checked at sizes other than the export's: by ``kiln export -o`` as by the pipeline, a size
where the model's own output holds no finite value is refused (the padding Kiln added named where it is the cause),
a Python loop over an axis is named as what fixed it, whatever the axis is called, and a listed size off the steps
a U-Net or an FPN takes sizes in is said as that."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
import torch
from click.testing import CliRunner
from torch import nn

from kiln.cli import main
from kiln.core.data import DatasetSplits
from kiln.core.errors import ModelError
from kiln.core.onnx_io import ort_session
from kiln.stages.export.declaration import MAX_PERIOD
from kiln.stages.export.sizes import check_validated_sizes
from kiln.stages.export.torch_export import export_onnx
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


# where the error names the loop: its ``for`` line
LOOP_AT = f"test_sizes_checked.py:{LoopScan.forward.__code__.co_firstlineno + 3}"


def loop() -> nn.Module:
    return LoopScan()


def cumsum() -> nn.Module:
    return CumsumScan()


def _export(factory: str, out: Path, *sets: str):
    args = ["export", "--model", f"{HERE}:{factory}", "--input-shape", "input=12:int64", "-o", str(out)]
    sets = ("signature.dynamic_axes={input: {1: seq}}", *sets)
    return CliRunner().invoke(main, [*args, *(a for s in sets for a in ("--set", s))])


def test_direct_export_refuses_a_loop_the_exporter_unrolled_at_the_example_length(tmp_path: Path) -> None:
    """A graph declared [batch, seq] but unrolled to the example's 12 steps, which ONNX Runtime cannot run at another
    length, is no file: the error names the loop's line."""
    out = tmp_path / "m.onnx"
    result = _export("loop", out)
    one_error(result, "does not compute the model at seq=6", LOOP_AT, "Python loop")
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
    with pytest.raises(ModelError, match=rf"seq=6.*in forward\(\) at .*{LOOP_AT} \(for t in") as err:
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
    """PyTorch's infinity everywhere at seq=24 would equal the graph's and pass with an error of 0: refused, the fix
    naming the sizes left."""
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
    """A U-Net's listed odd height fails with the steps it takes as the fix, not as axes to tie or rows Kiln cut."""
    axes = {"input": {2: "h", 3: "w"}}
    with pytest.raises(ModelError, match="the model fails at h=9, w=10") as err:
        _checked(tmp_path, TinyUNet(), torch.rand(12, 1, 16, 16), axes, {"h": [9, 16], "w": [10, 16]})
    assert err.value.hint == (
        "h=9 is not a size the model takes: it takes h in steps of 2 (8, 10, ...): list such sizes in signature.shapes"
    )
    _checked(tmp_path, TinyUNet(), torch.rand(12, 1, 16, 16), axes, {"h": [8, 16], "w": [10, 16]})


def test_an_axis_name_that_is_no_identifier_is_exported_and_checked_by_that_name(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``seq-len`` is no name torch.export.Dim takes: the dynamo exporter still exports the axis, declared by the
    config's name, and the loop that fixed a length is still named, by ``kiln export -o`` as by the pipeline."""
    axes, path = {"input": {1: "seq-len"}}, tmp_path / "m.onnx"
    export_onnx(CumsumScan().eval(), torch.randint(0, 4, (2, 12)), path, dynamic_axes=axes)
    assert "dynamo exporter failed" not in caplog.text
    assert [d.dim_param for d in onnx.load(str(path)).graph.input[0].type.tensor_type.shape.dim] == ["batch", "seq-len"]
    with pytest.raises(ModelError, match=rf"seq-len=6.*in forward\(\) at .*{LOOP_AT} \(for t in"):
        _checked(tmp_path, LoopScan(), torch.randint(0, 4, (12, 12)), axes, {})
    args = ["export", "--model", f"{HERE}:loop", "--input-shape", "input=12:int64", "-o", str(tmp_path / "d.onnx")]
    result = CliRunner().invoke(main, [*args, "--set", "signature.dynamic_axes={input: {1: seq-len}}"])
    one_error(result, "does not compute the model at seq-len=6", LOOP_AT, "Python loop")


class UnitSteps(nn.Module):
    """Each step scaled to unit length, then pooled: a step of zeros gives 0/0."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head((x / x.norm(dim=-1, keepdim=True)).mean(1))


class GrowsPastFloat32(nn.Module):
    """``exp`` of a sum of ones over time: finite at 8 steps (e^40), infinite at 24 (e^120) whatever the values."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(5 * torch.cumsum(x * 0 + 1, 1)).mean(1)


def test_nothing_finite_where_kilns_zero_padding_gives_it_blames_the_padding(tmp_path: Path) -> None:
    """Floats lengthened with zeros give a normalising model 0/0; on its own values repeated it is finite, so the
    error says the padding leaves nothing to compare and the fix keeps to the data's length. A model infinite on
    repeated values too is refused as overflowing."""
    x, axes = torch.randn(12, 16, 4), {"input": {1: "seq"}}
    with pytest.raises(ModelError, match=r"at seq=32, where Kiln lengthened the data's rows by padding") as err:
        _checked(tmp_path, UnitSteps(), x, axes, {"seq": [16, 32]})
    assert "give data whose rows have that length" in (err.value.hint or "")
    assert "sizes no longer than the data's (seq=16)" in (err.value.hint or "")
    with pytest.raises(ModelError, match=r"NaN or infinite at every value at seq=24: it overflows"):
        _checked(tmp_path, GrowsPastFloat32(), x[:, :8], axes, {"seq": [8, 24]})


class HeightBesideWidth(nn.Module):
    """``log(h - w/2 - 1)`` on an image of ones: NaN where the height is short beside the width."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x.sum(2).mean(-1) - x.sum(3).mean(-1) / 2 - 1) * self.scale


def test_the_sizes_a_nothing_finite_fix_suggests_leave_out_the_failing_size_on_the_axis_at_fault_only(
    tmp_path: Path,
) -> None:
    """At h=8, w=16 only h differs from the data's 16x16: w keeps both its listed sizes."""
    axes, shapes = {"input": {2: "h", 3: "w"}}, {"h": [8, 16], "w": [8, 16]}
    with pytest.raises(ModelError, match="NaN or infinite at every value at h=8, w=16") as err:
        _checked(tmp_path, HeightBesideWidth(), torch.ones(12, 1, 16, 16), axes, shapes)
    assert "signature.shapes: {h: [16], w: [8, 16]}" in (err.value.hint or "")


class SkipsMeet(nn.Module):
    """An FPN's size rule: it takes sizes 0 and 13-15 modulo 16 only, a period longer than eight sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] % 16 not in (0, 13, 14, 15):
            raise ValueError(f"size {x.shape[1]} does not meet the skip connection")
        return self.head(x).mean(1)


def test_a_listed_size_off_steps_of_a_long_period_is_said_with_them(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="the model fails at seq=17") as err:
        _checked(tmp_path, SkipsMeet(), torch.randn(12, 32, 4), {"input": {1: "seq"}}, {"seq": [17, 32]})
    assert err.value.hint == (
        "seq=17 is not a size the model takes: it takes seq at sizes 0, 13-15 modulo 16 (16, 29, ...): list such "
        "sizes in signature.shapes"
    )


class OneLength(nn.Module):
    """Checks its input's length itself: it takes 16 steps only."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] != 16:
            raise ValueError(f"length {x.shape[1]} != 16")
        return self.head(x).mean(1)


def test_a_listed_size_of_a_model_that_takes_one_length_is_said_to_be_fixed_after_a_short_probe(
    tmp_path: Path,
) -> None:
    """The step probe stops once a first sample shows the data's length alone runs (not the two periods of 64 it
    probes for steps), and the fix says the model fixes the axis: no size listed there but the data's would run."""
    model, x, axes = OneLength().eval(), torch.randn(12, 16, 4), {"input": {1: "seq"}}
    data, path = DatasetSplits(x[:8], None, x[8:], None), tmp_path / "m.onnx"
    export_onnx(model, x[:2], path, dynamic_axes=axes)
    calls: list[int] = []
    forward = model.forward
    model.forward = lambda t: calls.append(t.shape[1]) or forward(t)  # type: ignore[method-assign]
    with pytest.raises(ModelError, match="the model fails at seq=200") as err:
        check_validated_sizes(model, path, ort_session(path), data, ["input"], axes, {"seq": [16, 200]}, 1e-4)
    assert len(calls) < MAX_PERIOD
    assert "the model fixes axis 1 of 'input' (seq): it runs at the data's 16 alone there" in err.value.message
    assert (err.value.hint or "").startswith("remove the axis from signature.dynamic_axes"), err.value.hint


class UpToLength(nn.Module):
    """A position table of 16 rows sliced to the length: it takes 16 steps and fewer."""

    def __init__(self) -> None:
        super().__init__()
        self.pos, self.head = nn.Parameter(torch.randn(1, 16, 4)), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x + self.pos[:, : x.shape[1]]).mean(1)


def test_a_listed_size_past_a_models_largest_is_said_as_listed(tmp_path: Path) -> None:
    """A model that takes the data's length and shorter ones does not fix the axis: the listed size is at fault."""
    model, x, axes = UpToLength().eval(), torch.randn(12, 16, 4), {"input": {1: "seq"}}
    data, path = DatasetSplits(x[:8], None, x[8:], None), tmp_path / "m.onnx"
    export_onnx(model, x[:2], path, dynamic_axes=axes)
    with pytest.raises(ModelError, match="the model fails at seq=200") as err:
        check_validated_sizes(model, path, ort_session(path), data, ["input"], axes, {"seq": [16, 200]}, 1e-4)
    assert "fixes" not in err.value.message, err.value.message
    assert (err.value.hint or "").startswith("signature.shapes lists seq=200: list there only sizes the model takes")
