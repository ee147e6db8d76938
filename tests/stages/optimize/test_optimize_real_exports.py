"""Exports of models nobody here wrote (HF transformers BERT, an LSTM, an EmbeddingBag recommender, a model that
adds ``torch.zeros([])``, a UNet), tiny, through ``torch.onnx.export(dynamo=True)``: the default pipeline optimizes them
with nothing rolled back, keeps the PyTorch function, and is never behind onnxsim or onnxslim in node count."""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from kiln.stages.optimize.api import optimize_model
from kiln.stages.optimize.config import OptimizeConfig
from kiln.stages.optimize.verify import run_ort


class AddsZeros(nn.Module):
    """The issue's repro: torch.zeros([]) exports as Constant(value_floats=...) / value_ints=[] pieces."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + torch.zeros([])


class TinyLSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(6, 8, num_layers=2, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(x)[0][:, -1])


class TinyRecommender(nn.Module):
    def __init__(self, fields: int = 3) -> None:
        super().__init__()
        self.bags = nn.ModuleList(nn.EmbeddingBag(20, 4, mode="sum") for _ in range(fields))
        self.mlp = nn.Sequential(nn.Linear(4 * fields, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids: [batch, fields, bag]
        return self.mlp(torch.cat([bag(ids[:, i]) for i, bag in enumerate(self.bags)], dim=1))


class TinyBert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        transformers = pytest.importorskip("transformers")
        cfg = transformers.BertConfig(
            vocab_size=50,
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=16,
        )
        self.bert = transformers.BertModel(cfg).eval()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


class TinyUNet(nn.Module):
    """A UNet as its paper's popular PyTorch port writes it: the up path pads the upsampled map to the skip's size
    with F.pad (zero pads where the sizes already match, which the export keeps as constant-mode Pad nodes)."""

    def __init__(self, c: int = 4, classes: int = 3) -> None:
        super().__init__()
        self.inc = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.ReLU())
        self.down = nn.Sequential(nn.MaxPool2d(2), nn.Conv2d(c, 2 * c, 3, padding=1), nn.ReLU())
        self.up = nn.ConvTranspose2d(2 * c, c, 2, stride=2)
        self.conv = nn.Sequential(nn.Conv2d(2 * c, c, 3, padding=1), nn.ReLU())
        self.outc = nn.Conv2d(c, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1 = self.inc(x)
        x2 = self.up(self.down(x1))
        dy, dx = x1.size(2) - x2.size(2), x1.size(3) - x2.size(3)
        x2 = nn.functional.pad(x2, [dx // 2, dx - dx // 2, dy // 2, dy - dy // 2])
        return self.outc(self.conv(torch.cat([x1, x2], dim=1)))


CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[int], tuple[torch.Tensor, ...]]]] = {
    "adds_zeros": (AddsZeros, lambda b: (torch.randn(b, 8),)),
    "lstm": (TinyLSTM, lambda b: (torch.randn(b, 5, 6),)),
    "embedding_bag": (TinyRecommender, lambda b: (torch.randint(0, 20, (b, 3, 2)),)),
    "hf_bert": (TinyBert, lambda b: (torch.randint(0, 50, (b, 8)), torch.ones(b, 8, dtype=torch.long))),
    "unet": (TinyUNet, lambda b: (torch.randn(b, 3, 16, 16),)),
}


def export(model: nn.Module, args: tuple[torch.Tensor, ...], path: Path) -> onnx.ModelProto:
    names = [f"in{i}" for i in range(len(args))]
    batch = torch.export.Dim("batch", min=1, max=64)
    with warnings.catch_warnings(), redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            args,
            str(path),
            input_names=names,
            output_names=["out"],
            dynamo=True,
            optimize=False,
            dynamic_shapes=tuple({0: batch} for _ in args),
            opset_version=18,
        )
    return onnx.load(str(path))


@pytest.mark.parametrize("name", sorted(CASES))
def test_real_export_optimizes_fully_and_is_never_behind_the_peers(name: str, tmp_path: Path) -> None:
    onnxsim = pytest.importorskip("onnxsim")
    onnxslim = pytest.importorskip("onnxslim")
    make, inputs = CASES[name]
    torch.manual_seed(0)
    model = make().eval()
    raw = export(model, inputs(2), tmp_path / "raw.onnx")
    out, summary = optimize_model(raw, OptimizeConfig(int_high=1))  # ids/masks in {0, 1} suit every input here
    assert summary["rolled_back"] == [] and summary["checks"] == 1, summary["passes"]  # one check, no replay
    assert not any(n.op_type == "Identity" for n in out.graph.node)
    peers = [len(onnxsim.simplify(raw)[0].graph.node), len(onnxslim.slim(raw).graph.node)]
    assert len(out.graph.node) <= min(peers), f"kiln {len(out.graph.node)} nodes vs onnxsim/onnxslim {peers}"
    x = inputs(5)  # a batch the export never saw
    with torch.no_grad():
        ref = model(*x).numpy()
    got = run_ort(out, {f"in{i}": t.numpy() for i, t in enumerate(x)})["out"]
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
