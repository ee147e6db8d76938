"""Axes that share a name in ``signature.dynamic_axes`` are one size: data that gives them different sizes is a
mistake in the names (``{2: frames, 3: frames}`` for a video's frames and height), refused by the data check with a
fix that names each axis apart, before training or the exporter's traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from torch import nn

from kiln.cli import main
from kiln.core.data import DataContractError, DatasetSplits, check_axes_name_inputs, check_splits
from tests.core.test_ownership import one_error

HERE = "tests.core.test_data_tied_axes"


def clips(n: int = 8, frames: int = 4, size: int = 6) -> torch.Tensor:
    """Video clips ``[n, 3, frames, size, size]``."""
    return torch.rand(n, 3, frames, size, size, generator=torch.Generator().manual_seed(0))


def test_one_name_on_a_video_s_frames_and_height_is_refused_with_a_name_each() -> None:
    x = clips()
    with pytest.raises(DataContractError) as err:
        check_splits(DatasetSplits(x, None, x[:2], None), "mine:clips", {"input": {2: "frames", 3: "frames"}})
    assert err.value.message.startswith(
        "input 'input' axes 2 and 3 are both named 'frames' in signature.dynamic_axes, but dataset 'mine:clips' "
        "train_x gives them 4 and 6"
    ), err.value.message
    assert err.value.hint.startswith("give each axis its own name (signature.dynamic_axes: {input: {2: frames, 3: ")
    assert "3: frames}" not in err.value.hint


def test_axes_of_several_inputs_one_name_ties_are_refused_where_a_split_gives_them_apart() -> None:
    """ids and mask share 'seq': equal in each split, though the splits' lengths differ; a mask of its own length
    in one split is the mistake."""
    axes = {"ids": {1: "seq"}, "mask": {1: "seq"}}
    batch = lambda n, ids, mask: {"ids": torch.zeros(n, ids, dtype=torch.long), "mask": torch.ones(n, mask)}  # noqa: E731
    check_splits(DatasetSplits(batch(8, 16, 16), None, batch(2, 9, 9), None), "d", axes)
    with pytest.raises(DataContractError) as err:
        check_splits(DatasetSplits(batch(8, 16, 16), None, batch(2, 9, 12), None), "d", axes)
    assert "input 'ids' axis 1 and input 'mask' axis 1 are both named 'seq'" in err.value.message
    assert "dataset 'd' val_x gives them 9 and 12" in err.value.message
    assert "{ids: {1: seq}, mask: {1: seq_2}}" in (err.value.hint or "")


class _Pair(nn.Module):
    def forward(self, past: torch.Tensor, future: torch.Tensor) -> torch.Tensor:
        return past.mean(1) + future.mean(1)


def test_a_tuple_s_inputs_named_by_forward_are_checked_with_the_model() -> None:
    """The data check cannot name a tuple's inputs; the check that has the model does."""
    axes = {"past": {1: "time"}, "future": {1: "time"}}
    check_axes_name_inputs(_Pair(), (torch.zeros(2, 5), torch.zeros(2, 5)), axes)
    with pytest.raises(DataContractError, match="input 'past' axis 1 and input 'future' axis 1 are both named"):
        check_axes_name_inputs(_Pair(), (torch.zeros(2, 5), torch.zeros(2, 7)), axes)


def build() -> nn.Module:
    """A tiny video classifier over ``[B, 3, T, H, W]``."""
    return nn.Sequential(nn.Conv3d(3, 4, 3, padding=1), nn.AdaptiveAvgPool3d(1), nn.Flatten(), nn.Linear(4, 2))


def load() -> DatasetSplits:
    x, y = clips(12), torch.arange(12) % 2
    return DatasetSplits(x[:8], y[:8], x[8:], y[8:], num_classes=2)


def test_a_run_whose_axes_one_name_ties_differ_stops_before_training_with_one_error(tmp_path: Path) -> None:
    cfg = {
        "model": {"name": f"{HERE}:build"},
        "data": {"name": f"{HERE}:load"},
        "train": {"epochs": 1},
        "signature": {"batch_sizes": [1, 2], "dynamic_axes": {"input": {2: "frames", 3: "frames"}}},
    }
    path = tmp_path / "video.yaml"
    path.write_text(yaml.safe_dump(cfg))
    result = CliRunner().invoke(main, ["run", str(path), "-w", str(tmp_path / "w")])
    one_error(result, "axes 2 and 3 are both named 'frames'", "give each axis its own name")
    assert not list((tmp_path / "w").rglob("*.safetensors")), "refused before training"
