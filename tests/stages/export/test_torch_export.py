"""kiln.stages.export.torch_export: where the dynamo exporter fixes a dynamic axis, the log names the setting that
made the axis dynamic (the batch: export.dynamic_batch; another axis: signature.dynamic_axes)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn

from kiln.core.onnx_io import index_ranges
from kiln.stages.export.torch_export import _fixed_axes_text, export_with_fallback


class Guidance(nn.Module):
    """Classifier-free guidance in one forward: the batch twice, once with the null class (row 4 of the embedding),
    split in two after; the dynamo exporter fixes the batch where it meets ``chunk``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.lin = nn.Embedding(5, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        e = self.lin(torch.cat([x, x])) + self.emb(torch.cat([y, torch.full_like(y, 4)]))
        c, u = e.chunk(2)
        return u + 3 * (c - u)


def test_a_batch_the_dynamo_exporter_fixed_is_said_as_export_dynamic_batchs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No signature.dynamic_axes was set: the warning names export.dynamic_batch, which made the batch dynamic; the
    TorchScript graph it falls back to keeps the null class's row within the embedding's range of y."""
    example = {"x": torch.randn(2, 4), "y": torch.zeros(2, dtype=torch.long)}
    with caplog.at_level(logging.WARNING):
        proto, refused = export_with_fallback(Guidance().eval(), example, tmp_path / "m.onnx")
    assert refused.startswith(
        "it fixed input 'x' axis 0 (batch), input 'y' axis 0 (batch), which export.dynamic_batch makes dynamic; torch "
        "named no line: if the model splits the batch into a fixed number of pieces (chunk, split or unbind"
    ), refused
    assert "signature.dynamic_axes" not in caplog.text, caplog.text
    assert index_ranges(proto) == {"y": [0, 4]}


def test_each_fixed_axis_is_said_with_the_setting_that_made_it_dynamic() -> None:
    lost = [("x", 0, "batch"), ("x", 2, "time"), ("mask", 1, "time")]
    assert _fixed_axes_text(lost, {"x": {2: "time"}, "mask": {1: "time"}}) == (
        "input 'x' axis 0 (batch), which export.dynamic_batch makes dynamic, and input 'x' axis 2 (time), input "
        "'mask' axis 1 (time), which signature.dynamic_axes makes dynamic"
    )
    # an axis 0 signature.dynamic_axes names itself (a count of its own, export.dynamic_batch off) is its
    assert _fixed_axes_text([("texts", 0, "n")], {"texts": {0: "n"}}) == (
        "input 'texts' axis 0 (n), which signature.dynamic_axes makes dynamic"
    )
