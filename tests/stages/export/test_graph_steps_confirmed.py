"""The export's step probe: a period is recorded only where it was seen repeat (two whole periods, or confirmed at a
size past the range), never made of two sizes that ran; sizes it cannot confirm are recorded as those sizes. The
probe says when it starts running sizes one by one, which takes a forward each."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from torch import nn

from kiln import DatasetSplits
from kiln.pipeline.api import run_pipeline
from kiln.pipeline.config import config_from_dict
from kiln.stages.export.size_steps import size_pattern

PATCH = 32


class PadsToPatches(nn.Module):
    """Patches of 32 steps, after padding on the left where the length is not a multiple of 32 (the branch the
    exporter fixes: the graph of data at 64 never pads); ``positions``: a position per patch, which caps the length
    PyTorch takes at that many patches."""

    def __init__(self, positions: int = 0) -> None:
        super().__init__()
        self.embed, self.head = nn.Linear(PATCH, 8), nn.Linear(8, 3)
        self.positions = nn.Parameter(torch.zeros(positions, 8)) if positions else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, L, C]
        length = x.shape[1]
        if length % PATCH != 0:
            x = torch.cat([x[:, :1].repeat(1, PATCH - length % PATCH, 1), x], dim=1)
        h = torch.relu(self.embed(x.permute(0, 2, 1).unfold(-1, PATCH, PATCH)))  # [B, C, N, 8]
        if self.positions is not None:
            h = h + self.positions[: h.shape[2]]
        return self.head(h.mean((1, 2)))


def any_length() -> nn.Module:
    return PadsToPatches()


def three_patches() -> nn.Module:
    return PadsToPatches(positions=3)


def at_64() -> DatasetSplits:
    x = torch.randn(24, 64, 2, generator=torch.Generator().manual_seed(0)).cumsum(1)
    return DatasetSplits(x[:16], None, x[16:], None)


# steps that list their sizes: a period past any size, each residue a size itself
LISTED = 65536


def _steps(tmp_path: Path, model: str) -> dict[str, list[int]]:
    """The export's axis steps for ``model`` on data at 64, validated at 64 and 96."""
    cfg = config_from_dict(
        {
            "model": {"name": f"{__name__}:{model}"},
            "data": {"name": f"{__name__}:at_64"},
            "train": {"enabled": False},
            "signature": {"batch_sizes": [1, 4], "dynamic_axes": {"input": {1: "seq"}}, "shapes": {"seq": [64, 96]}},
        }
    )
    result, _ = run_pipeline(cfg, tmp_path, stop="export")
    assert result.error is None, result.error
    return json.loads((tmp_path / "export" / "manifest.json").read_text())["summary"]["axis_steps"]


def test_two_sizes_and_one_past_the_range_record_the_period(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The graph is right at 64 and 96 (no padding there) and wrong between: the probe confirms steps of 32 at 128,
    which the model takes too, and says it starts probing. Before: a period of 33, the range's width, made of the
    two sizes (``[33, 30, 31]``: "sizes 30-31 modulo 33")."""
    with caplog.at_level(logging.INFO, logger="kiln.export"):
        assert _steps(tmp_path, "any_length") == {"seq": [32, 0]}
    assert "signature axis seq: probing 33 sizes from 64 to 96, a run each: the graph computed PyTorch's outputs" in (
        caplog.text
    )
    assert "only at seq in steps of 32" in caplog.text


def test_two_sizes_the_model_takes_alone_are_recorded_as_those_sizes(tmp_path: Path) -> None:
    """Three positions: PyTorch fails at 128, so steps of 32 cannot be confirmed: 64 and 96 are recorded as sizes."""
    assert _steps(tmp_path, "three_patches") == {"seq": [LISTED, 64, 96]}


def test_a_period_needs_two_whole_periods_or_a_size_past_the_range() -> None:
    """The probe's rule on its own: sizes that run in steps of 32 from 64 are steps of 32 where 128 runs, and 64 and
    96 alone where it does not; a power-of-two step is found without running every size of the range."""
    tried: list[int] = []
    assert size_pattern(lambda size: tried.append(size) or size % 32 == 0, 64, 96) == [32, 0]
    assert 128 in tried and len(set(tried)) < 33
    assert size_pattern(lambda size: size in (64, 96), 64, 96) == [LISTED, 64, 96]
