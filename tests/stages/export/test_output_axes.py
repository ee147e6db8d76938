"""Output axes that follow a dynamic input axis are found by running the export, and declared dynamic in it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import torch
from torch import nn

from kiln.stages.export.output_axes import name_output_axes, resized
from kiln.stages.export.stage import export_onnx


class Steps(nn.Module):
    """A GRU tagger: per-step features (length follows ``seq``; torch.export fixes it), the steps twice over
    (follows ``seq`` by a rule of its own), and pooled logits (fixed)."""

    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(4, 6, batch_first=True)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        steps, _ = self.gru(x)
        return steps, torch.cat([steps, steps], dim=1), self.head(steps.mean(1))


def _dims(model: onnx.ModelProto) -> dict[str, list[int | str]]:
    return {o.name: [d.dim_param or d.dim_value for d in o.type.tensor_type.shape.dim] for o in model.graph.output}


def test_an_rnn_s_step_output_is_declared_dynamic_and_a_pooled_one_stays_fixed(tmp_path: Path) -> None:
    path = tmp_path / "model.onnx"
    x = torch.randn(2, 10, 4)
    export_onnx(Steps().eval(), {"x": x}, path, dynamic_axes={"x": {1: "seq"}})
    feed = {"x": x.numpy()}
    fixed = name_output_axes(path, feed, {"x": {0: "batch", 1: "seq"}})
    dims = _dims(onnx.load(str(path)))
    assert dims["output_0"][1] == "seq" and dims["output_2"] == ["batch", 3], dims
    assert dims["output_1"][1] not in (10, 20, "seq") and isinstance(dims["output_1"][1], str), dims
    assert set(fixed) <= {"output_0", "output_1"}
    assert name_output_axes(path, feed, {"x": {0: "batch", 1: "seq"}}) == {}  # declared now: nothing to fix


def test_resized_repeats_or_cuts_every_axis_of_that_name() -> None:
    feed = {"ids": np.arange(6).reshape(1, 6), "mask": np.ones((1, 6)), "other": np.zeros((1, 2))}
    axes = {"ids": {1: "seq"}, "mask": {1: "seq"}}
    small, big = resized(feed, axes, "seq", 3), resized(feed, axes, "seq", 8)
    assert small["ids"].tolist() == [[0, 1, 2]] and big["ids"].tolist() == [[0, 1, 2, 3, 4, 5, 0, 1]]
    assert small["mask"].shape == (1, 3) and small["other"].shape == (1, 2)
