"""An axis besides the batch may be empty (a decoder's KV cache at the prefill step): ``signature.shapes`` takes 0
for it, the run exports, builds and validates at that size, and the engine takes it; the batch never takes 0."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file
from torch import nn

from kiln import DatasetSplits
from kiln.core.errors import InputError
from kiln.core.signature import Signature
from kiln.pipeline.api import run_pipeline
from kiln.pipeline.config import config_from_dict
from kiln.stages.engines.backend import engine_dirs
from kiln.stages.engines.registry import load_engine

DIM, NEW, PAST = 8, 2, 4


class CachedStep(nn.Module):
    """A decoder step's shape: the new positions ``x [B, S, D]`` after the cache ``past [B, P, D]``, projected and
    summed over positions; at ``P = 0`` it is the prefill step."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, 3)

    def forward(self, x: torch.Tensor, past: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.cat([past, x], 1)).sum(1)


def build() -> nn.Module:
    return CachedStep()


def load() -> DatasetSplits:
    g = torch.Generator().manual_seed(0)
    x = {"x": torch.randn(24, NEW, DIM, generator=g), "past": torch.randn(24, PAST, DIM, generator=g)}
    return DatasetSplits({k: v[:16] for k, v in x.items()}, None, {k: v[16:] for k, v in x.items()}, None)


def test_shapes_take_0_for_an_axis_besides_the_batch() -> None:
    assert Signature(shapes={"past": [0, 8]}).axis_ranges() == {"past": [0, 8]}


@pytest.mark.parametrize(
    "shapes, needle",
    [
        ({"batch": [0, 4]}, "the batch takes no size 0; give batch sizes of at least 1 in signature.batch_sizes"),
        ({"past": [-1, 4]}, "give one or more sizes of 0 or more"),
        ({"past": []}, "give one or more sizes of 0 or more"),
    ],
)
def test_shapes_refuse_an_empty_batch_and_negative_sizes(shapes: dict, needle: str) -> None:
    with pytest.raises(ValidationError, match=needle):
        Signature(shapes=shapes)


def test_a_run_declaring_an_empty_past_validates_and_serves_it(tmp_path: Path) -> None:
    cfg = config_from_dict(
        {
            "model": {"name": f"{__name__}:build"},
            "data": {"name": f"{__name__}:load"},
            "train": {"enabled": False},
            "signature": {"batch_sizes": [1, 4], "dynamic_axes": {"past": {1: "past"}}, "shapes": {"past": [0, 4]}},
            "precision": {"variants": ["fp32"]},
            "build": {"backends": ["onnxruntime"]},
            "validate": {"warmup": 1, "iterations": 3},
        }
    )
    result, _ = run_pipeline(cfg, tmp_path, stop="validate")
    assert result.error is None, result.error
    (engine,) = engine_dirs(tmp_path / "build")
    x = np.random.default_rng(0).standard_normal((2, NEW, DIM)).astype(np.float32)
    with load_engine(engine) as runner:
        assert runner.meta.axis_ranges == {"past": [0, 4]}
        empty = runner.infer({"x": x, "past": np.zeros((2, 0, DIM), np.float32)})["logits"]
        with pytest.raises(InputError, match="input 'x' has 0 rows") as err:  # the batch: never empty
            runner.infer({"x": x[:0], "past": np.zeros((0, 0, DIM), np.float32)})
    assert "one row or more" in err.value.hint
    model = CachedStep().eval()
    model.load_state_dict(load_file(tmp_path / "train" / "model.safetensors"))
    with torch.no_grad():
        want = model(torch.from_numpy(x), torch.zeros(2, 0, DIM)).numpy()
    np.testing.assert_allclose(empty, want, atol=1e-5)
    validated = json.loads((tmp_path / "validate" / "validation.json").read_text())["engines"][0]
    assert validated["passed"] and validated["shapes"] == [{"past": 0}, {"past": PAST}]
