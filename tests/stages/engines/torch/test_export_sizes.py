"""An axis torch.export takes at one size only (an nn.GRU's length): the torch engine is built for that size and says
so in its inputs, while the ONNX engines keep the axis dynamic."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from kiln.core.records import TensorSpec
from kiln.stages.engines.backend import BuildRequest
from kiln.stages.engines.torch.build import _export, with_one_size
from kiln.stages.engines.torch.config import TorchConfig


class GRUModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.rnn, self.head = nn.Embedding(20, 8), nn.GRU(8, 8, batch_first=True), nn.Linear(8, 3)

    def forward(self, *xs: torch.Tensor) -> tuple[torch.Tensor]:
        out, _ = self.rnn(self.emb(xs[0]))
        return (self.head(out.mean(1)),)


def test_the_axis_torch_export_pins_is_reported_by_input_and_size() -> None:
    dims = {0: torch.export.Dim("batch", min=1, max=8), 1: torch.export.Dim("seq", min=2, max=16)}
    program, one_size, steps = _export(GRUModel().eval(), (torch.randint(0, 20, (2, 12)),), ((dims,),), ["tokens"])
    assert one_size == {"tokens": {1: 12}} and steps == {}
    x = torch.randint(0, 20, (5, 12))  # the batch stays dynamic
    assert program.module()(x)[0].shape == (5, 3)


def test_the_request_takes_the_pinned_size_in_its_inputs_and_drops_the_axis_range(tmp_path: Path) -> None:
    req = BuildRequest(
        tmp_path / "m.onnx",
        tmp_path / "out",
        "cpu",
        "fp32",
        TorchConfig(),
        tmp_path,
        [
            TensorSpec(name="ids", shape=["batch", "seq"], dtype="int64"),
            TensorSpec(name="mask", shape=["batch", "seq"], dtype="int64"),
        ],
        axis_sizes={"seq": [8, 12]},
    )
    pinned = with_one_size(req, {"ids": {1: 12}, "mask": {1: 12}})
    assert [s.shape for s in pinned.inputs] == [["batch", 12], ["batch", 12]] and pinned.axis_sizes == {}


class Halves(nn.Module):
    """Pools and upsamples back, then adds the input: the height must be even (a U-Net's skip connection)."""

    def forward(self, *xs: torch.Tensor) -> tuple[torch.Tensor]:
        x = xs[0]
        return (x + nn.functional.interpolate(nn.functional.max_pool2d(x, 2), scale_factor=2),)


def test_an_axis_torch_export_takes_in_steps_is_reported_with_its_step() -> None:
    """torch.export's fix for a U-Net's height (h = 2*_h) keeps the axis dynamic in steps of 2: recorded, so that
    requests between the steps, which the compiled program would answer with a wrong shape, are refused."""
    from kiln.stages.engines.torch.build import _step

    dims = {0: torch.export.Dim("batch", min=1, max=8), 2: torch.export.Dim("h", min=8, max=32)}
    _, one_size, steps = _export(Halves().eval(), (torch.randn(2, 1, 16, 4),), ((dims,),), ["image"])
    assert one_size == {} and steps == {"image": {2: (2, 0)}}
    assert _step(torch.export.Dim("h")) is None and _step(3 * torch.export.Dim("k") + 1) == (3, 1)


class TwoTowers(nn.Module):
    def forward(self, *xs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return xs[0].float().mean(1, keepdim=True), xs[1] * 2


def test_first_axes_of_their_own_stay_apart_and_a_shared_batch_stays_one(tmp_path: Path) -> None:
    """A two-tower model's texts and images get a Dim each (served 5 texts with 2 images); ids and a mask named
    with one batch share one."""
    from kiln.stages.engines.torch.build import _dynamic_shapes

    def request(*inputs: TensorSpec) -> BuildRequest:
        return BuildRequest(tmp_path / "m.onnx", tmp_path, "cpu", "fp32", TorchConfig(), tmp_path, list(inputs))

    towers = request(
        TensorSpec(name="tokens", shape=["texts", 6], dtype="int64"),
        TensorSpec(name="pixels", shape=["images", 4], dtype="float32"),
    )
    ((tokens, pixels),) = _dynamic_shapes(towers)
    assert tokens[0] is not pixels[0] and str(tokens[0]) != str(pixels[0])
    args = (torch.randint(0, 5, (2, 6)), torch.rand(2, 4))
    program, _, _ = _export(TwoTowers().eval(), args, _dynamic_shapes(towers), ["tokens", "pixels"])
    texts, images = program.module()(torch.randint(0, 5, (5, 6)), torch.rand(2, 4))
    assert texts.shape == (5, 1) and images.shape == (2, 4)
    ((ids, mask),) = _dynamic_shapes(
        request(
            TensorSpec(name="ids", shape=["batch", 6], dtype="int64"),
            TensorSpec(name="mask", shape=["batch", 6], dtype="int64"),
        )
    )
    assert ids[0] is mask[0]
