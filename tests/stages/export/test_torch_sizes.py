"""PyTorch at a size the later stages run (:func:`kiln.stages.export.torch_sizes.torch_at`): where the model fixes the
axis a config makes vary (a video's channel axis named as frames), the error says so and the fix leads with removing
that axis; where it fails only at the size Kiln cut the rows to, the fix still speaks of the cutting."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from kiln.core.data import from_feed
from kiln.core.errors import ModelError
from kiln.core.shapes import resize
from kiln.stages.export.torch_sizes import torch_at


def _fails(model: nn.Module, feed: dict[str, np.ndarray], axes: dict, point: dict[str, int]) -> ModelError:
    """torch_at's error on ``feed`` (as the held-out rows and a row of each split) resized to ``point``."""
    like = torch.from_numpy(feed["input"])
    inputs = from_feed(resize(feed, axes, point), like)
    with pytest.raises(ModelError) as err:
        torch_at(model.eval(), inputs, point, [feed, feed, feed], axes, {})
    return err.value


def test_a_channel_axis_made_dynamic_is_said_to_be_fixed_by_the_model() -> None:
    """NCTHW clips with axis 1 (the 3 channels) named frames: a Conv3d takes 3 channels alone."""
    feed = {"input": np.random.default_rng(0).random((2, 3, 4, 6, 6), dtype=np.float32)}
    axes = {"input": {1: "frames"}}
    err = _fails(nn.Conv3d(3, 4, 3, padding=1), feed, axes, {"frames": 1})
    assert "the model fixes axis 1 of 'input' (frames): it runs at the data's 3 alone there, not at 1, 4 or 6" in (
        err.message
    ), err.message
    assert (err.hint or "").startswith(
        "remove the axis from signature.dynamic_axes (axis 1 of 'input': the model takes only 3 there); if another "
        "axis varies, name that one instead (samples in the data: 'input' [3, 4, 6, 6])"
    ), err.hint


def test_a_model_that_fails_only_at_the_size_kiln_cut_is_not_said_to_fix_it() -> None:
    """A kernel of 5 without padding takes 5 steps and more: cut from 6 to 3 it fails, at 7 and 12 it runs."""
    feed = {"input": np.random.default_rng(0).random((2, 2, 6), dtype=np.float32)}
    axes = {"input": {2: "time"}}
    err = _fails(nn.Conv1d(2, 3, 5), feed, axes, {"time": 3})
    assert "fixes" not in err.message, err.message
    assert (err.hint or "").startswith("Kiln made that size by cutting the data's rows (its own: time=6)"), err.hint


class _Graph(nn.Module):
    """Node features [N, n, 4] and a square distance matrix [N, n, n] (a Graphormer's spd): both of spd's axes
    follow the nodes."""

    def forward(self, x: torch.Tensor, spd: torch.Tensor) -> torch.Tensor:
        return (spd @ x).sum(1)


def test_a_square_input_declared_on_one_axis_is_told_to_declare_the_other() -> None:
    rng = np.random.default_rng(0)
    feed = {"x": rng.random((2, 12, 4), dtype=np.float32), "spd": rng.random((2, 12, 12), dtype=np.float32)}
    axes, point = {"x": {1: "n"}, "spd": {1: "n"}}, {"n": 6}
    inputs = from_feed(resize(feed, axes, point), {k: torch.from_numpy(v) for k, v in feed.items()})
    with pytest.raises(ModelError, match=r"the model fails at n=6") as err:
        torch_at(_Graph().eval(), inputs, point, [feed, feed, feed], axes, {})
    hint = err.value.hint or ""
    assert hint.startswith(
        "if input 'spd' (axis 2: 12 in the data, as n) varies with it, declare that too, "
        "signature.dynamic_axes: {spd: {1: n, 2: n}}; else"
    ), hint
    assert "remove the axes" not in hint


class _CacheStep(nn.Module):
    """A KV-cache step: a mask of ``total = past + 1`` columns over the cache of ``past`` steps and the new one."""

    def forward(self, mask: torch.Tensor, past: torch.Tensor) -> torch.Tensor:
        keys = torch.cat([past, past[:, -1:]], dim=1)
        return (keys * mask[..., None]).sum(1)


def test_axes_tied_by_an_offset_are_said_to_be_tied_not_fixed() -> None:
    """The step runs at any past with total one more, never with past moved alone: not an axis the model fixes."""
    rng = np.random.default_rng(0)
    feed = {"mask": np.ones((2, 4), dtype=np.float32), "past": rng.random((2, 3, 2), dtype=np.float32)}
    axes = {"mask": {1: "total"}, "past": {1: "past"}}
    point = {"past": 1, "total": 4}
    like = {k: torch.from_numpy(v) for k, v in feed.items()}
    with pytest.raises(ModelError) as err:
        torch_at(_CacheStep(), from_feed(resize(feed, axes, point), like), point, [feed, feed], axes, {})
    message, hint = err.value.message, err.value.hint or ""
    assert "fixes" not in message and "tied by an offset" in message and "(total = past + 1" in message, message
    assert hint.startswith("give the inputs of total the length of past and one name for both, past"), hint
    assert "remove" not in hint, hint
