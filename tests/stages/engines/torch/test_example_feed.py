"""The torch backend's own example inputs (capture, warm-up): an input the graph uses as an index, a float timestep
cast to one included, is drawn within its table, so the build runs the model on inputs it takes."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from kiln.core.records import TensorSpec
from kiln.stages.engines import stage
from kiln.stages.engines.backend import BuildRequest
from kiln.stages.engines.config import BuildConfig
from kiln.stages.engines.torch.build import _autocast_reason, _example_feed
from kiln.stages.export.torch_export import export_onnx


class Denoiser(nn.Module):
    """A float timestep ``t`` [B] looked up in a 50-row table after ``.long()``, as a diffusion model's."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(50, 4)
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.lin(x + self.emb(t.long()))


def test_a_float_index_is_drawn_as_whole_numbers_within_its_range(tmp_path: Path) -> None:
    specs = [
        TensorSpec(name="x", dtype="float32", shape=["batch", 4]),
        TensorSpec(name="t", dtype="float32", shape=["batch"]),
    ]
    req = BuildRequest(tmp_path / "m.onnx", tmp_path, "cpu", "fp32", None, tmp_path, specs, index_ranges={"t": [0, 49]})
    feed = _example_feed(req, 64)
    t = feed["t"]
    assert t.dtype == np.float32 and np.array_equal(t, np.round(t)) and t.min() >= 0 and t.max() <= 49
    assert len(np.unique(t)) > 10 and not np.array_equal(feed["x"], np.round(feed["x"]))


def test_the_build_stage_hands_the_backend_the_graphs_index_ranges(tmp_path: Path, monkeypatch) -> None:
    export_onnx(Denoiser().eval(), {"x": torch.randn(2, 4), "t": torch.tensor([3.0, 7.0])}, tmp_path / "m.onnx")
    seen: list[BuildRequest] = []

    class Caught(Exception):
        pass

    def build(req: BuildRequest) -> None:
        seen.append(req)
        raise Caught

    monkeypatch.setattr(
        stage,
        "_check_choice",
        lambda *_: SimpleNamespace(engine_name=lambda *_: "e", settings=lambda c: c, build=build),
    )
    with pytest.raises(Caught):
        stage.build_engine(tmp_path / "m.onnx", tmp_path / "e", "torch", "cuda", "fp16", BuildConfig(), tmp_path / "c")
    assert seen[0].index_ranges == {"t": [0, 49]}


def test_a_float16_build_runs_the_model_on_its_example_feed(tmp_path: Path) -> None:
    """A float16 engine's build runs the model eagerly (its autocast check): at batch 32 a standard normal timestep
    holds values below -1, and ``emb(t.long())`` failed with "index out of range in self"."""
    specs = [
        TensorSpec(name="x", dtype="float32", shape=["batch", 4]),
        TensorSpec(name="t", dtype="float32", shape=["batch"]),
    ]
    req = BuildRequest(tmp_path / "m.onnx", tmp_path, "cpu", "fp16", None, tmp_path, specs, index_ranges={"t": [0, 49]})
    feed = _example_feed(req, 32)
    assert _autocast_reason(Denoiser().eval(), req, tuple(torch.from_numpy(feed[s.name]) for s in specs)) is None
