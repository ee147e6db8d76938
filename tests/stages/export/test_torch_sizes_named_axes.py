"""The fix :func:`kiln.stages.export.torch_sizes.torch_at` gives names the axes in question alone: where the model
itself takes one size of an axis (a Whisper encoder's mel frames), the fix is removing that axis, with no sizes to
validate at that would send the export on to fail where the model pins it; where Kiln cut the rows, the sizes it
suggests are the cut axis's, not those of another axis that varies fine."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from kiln.core.data import from_feed
from kiln.core.errors import ModelError
from kiln.core.shapes import resize
from kiln.stages.export.torch_sizes import torch_at


class _Frames(nn.Module):
    """Features [N, 4, frames] flattened into a linear layer (which takes 8 frames alone) beside token ids [N, tgt],
    which vary fine; or, with ``kernel``, a Conv1d over the frames (which takes ``kernel`` frames and more)."""

    def __init__(self, kernel: int = 0) -> None:
        super().__init__()
        self.kernel = kernel
        self.proj = nn.Conv1d(4, 3, kernel) if kernel else nn.Linear(4 * 8, 3)
        self.emb = nn.Embedding(10, 3)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        feats = self.proj(x).mean(-1) if self.kernel else self.proj(x.flatten(1))
        return feats.unsqueeze(1) + self.emb(ids)


_AXES = {"x": {2: "frames"}, "ids": {1: "tgt"}}


def _fails(model: nn.Module, point: dict[str, int]) -> ModelError:
    """torch_at's error on rows of 8 frames and 5 tokens (as the held-out rows and a row of each split) resized to
    ``point``."""
    rng = np.random.default_rng(0)
    feed = {"x": rng.random((2, 4, 8), dtype=np.float32), "ids": rng.integers(0, 10, (2, 5), dtype=np.int64)}
    like = {"x": torch.from_numpy(feed["x"]), "ids": torch.from_numpy(feed["ids"])}
    inputs = from_feed(resize(feed, _AXES, point), like)
    with pytest.raises(ModelError) as err:
        torch_at(model.eval(), inputs, point, [feed, feed, feed], _AXES, {})
    return err.value


def test_an_axis_the_model_fixes_is_to_be_removed_with_no_sizes_to_validate_at() -> None:
    err = _fails(_Frames(), {"frames": 4, "tgt": 5})
    assert "the model fixes axis 2 of 'x' (frames): it runs at the data's 8 alone there" in err.message, err.message
    hint = err.hint or ""
    assert hint.startswith("remove the axis from signature.dynamic_axes (axis 2 of 'x': the model takes only 8"), hint
    assert "signature.shapes" not in hint and "cutting" not in hint and "tgt" not in hint, hint


def test_sizes_suggested_where_kiln_cut_the_rows_are_the_cut_axis_alone() -> None:
    """A kernel of 6 takes 6 frames and more: cut from 8 to 4 it fails, at 8 and 16 it runs; tokens vary fine."""
    err = _fails(_Frames(kernel=6), {"frames": 4, "tgt": 5})
    hint = err.hint or ""
    assert "Kiln made that size by cutting the data's rows (its own: frames=8)" in hint, hint
    assert "signature.shapes: {frames: [8, 16]}" in hint and "tgt" not in hint, hint
