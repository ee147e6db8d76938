"""The export's step probe: a period is recorded only where it was seen repeat (two whole periods, or confirmed at a
size past the range), never made of two sizes that ran; sizes it cannot confirm are recorded as those sizes. The
probe says when it starts running sizes one by one, which takes a forward each."""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from kiln import DatasetSplits
from kiln.core.records import takes_size
from kiln.pipeline.api import run_pipeline
from kiln.pipeline.config import config_from_dict
from kiln.stages.export.declaration import MAX_PERIOD
from kiln.stages.export.size_steps import first_probes, size_pattern

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
    said = "signature axis seq: probing up to 33 sizes from 64 to 96, a run each: the graph computed PyTorch's outputs"
    assert said in caplog.text
    assert "only at seq in steps of 32" in caplog.text


def test_two_sizes_the_model_takes_alone_are_recorded_as_those_sizes(tmp_path: Path) -> None:
    """Three positions: PyTorch fails at 128, so steps of 32 cannot be confirmed: 64 and 96 are recorded as sizes."""
    assert _steps(tmp_path, "three_patches") == {"seq": [LISTED, 64, 96]}


def test_a_period_needs_two_whole_periods_or_a_size_past_the_range() -> None:
    """The probe's rule on its own: sizes that run in steps of 32 from 64 are steps of 32 where 128 runs, and 64 and
    96 alone where it does not; a power-of-two step is found without running every size of a range wider than two
    of its periods."""
    tried: list[int] = []
    assert size_pattern(lambda size: tried.append(size) or size % 32 == 0, 64, 96) == [32, 0]
    assert 128 in tried
    tried.clear()
    assert size_pattern(lambda size: tried.append(size) or size % 8 == 0, 64, 600) == [8, 0]
    assert len(set(tried)) < 2 * MAX_PERIOD + 1
    assert size_pattern(lambda size: size in (64, 96), 64, 96) == [LISTED, 64, 96]


def test_a_power_of_two_step_is_kept_only_where_no_size_off_it_runs() -> None:
    """A model that runs where L % 8 == 0 or L % 12 == 0: its sizes from 48 repeat every 24, not every 8, so 60
    runs though it lies off steps of 8 from 48. Before: steps of 8 from the sizes on them alone, 60 refused."""
    pattern = size_pattern(lambda size: size % 8 == 0 or size % 12 == 0, 48, 200)
    assert pattern == [24, 0, 8, 12, 16] and takes_size(pattern, 60)


def _synthetic(rng: random.Random, low: int, high: int) -> Callable[[int], bool]:
    """The sizes a made-up model runs at: residues of a period, multiples of two steps, multiples of a step up to a
    length, or a few sizes."""
    kind = rng.randrange(4)
    if kind == 0:
        period = rng.choice([2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64])
        residues = set(rng.sample(range(period), rng.randint(1, max(1, period // 2))))
        return lambda size: size % period in residues
    if kind == 1:
        a, b = rng.sample([2, 3, 4, 6, 8, 12, 16, 24, 32], 2)
        return lambda size: size % a == 0 or size % b == 0
    if kind == 2:
        most, step = rng.randint(low, high), rng.choice([1, 2, 4, 8])
        return lambda size: size <= most and size % step == 0
    sizes = set(rng.sample(range(low, high + 1), min(high - low + 1, rng.randint(1, 6))))
    return lambda size: size in sizes


def test_the_steps_found_take_every_size_that_runs_and_none_that_fails() -> None:
    """Over made-up models, checked against every size: where the probe records steps, they take each size that
    runs within two of their periods from the range's start (within the range probed), and no size there that
    fails; where it records none, every size it tried first ran. Before: a power-of-two step seen on its own grid
    dropped sizes off it that run (multiples of 12 among steps of 8)."""
    rng = random.Random(0)
    for _ in range(400):
        low = rng.randint(1, 200)
        high = low + rng.choice([rng.randint(3, 40), rng.randint(40, 128), rng.randint(129, 400)])
        runs = _synthetic(rng, low, high)
        pattern = size_pattern(runs, low, high)
        top = min(high, low + 2 * MAX_PERIOD)
        if pattern is None:
            assert all(runs(size) for size in first_probes(low, top)) or top < high, (low, high)
            continue
        held = range(low, min(top, low + 2 * pattern[0]) + 1)
        assert all(takes_size(pattern, s) for s in held if runs(s)), (low, high, pattern)
        assert not any(takes_size(pattern, s) for s in range(low, top + 1) if not runs(s)), (low, high, pattern)


def test_the_line_a_dynamo_fixed_axis_names_is_said_by_its_file_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the dynamo exporter failed by fixing a dynamic axis, the error and its fix name the user's line as the
    message's other lines do (``mine.py:40``), not by the absolute path the line was found at."""
    from kiln.stages.export import torch_export

    found = str(Path("/home/me/models/mine.py").absolute()) + ":40 (for t in range(l):)"
    monkeypatch.setattr(torch_export, "pinned_at", lambda *_: "forward() at " + found)
    errors = ["dynamo exporter: it fixed input 'x' axis 1 (seq)", "torchscript exporter: no op"]
    error = torch_export._export_failed(nn.Identity(), {}, errors, 18, {"x": {1: "seq"}})
    assert "(in forward() at mine.py:40 (for t in range(l):))" in error.message, error.message
    assert "/home/me" not in error.message + str(error.hint), error.hint
