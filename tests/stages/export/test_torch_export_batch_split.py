"""The dynamo exporter's failure where it fixed the batch and torch's log named no line
(:func:`kiln.stages.export.torch_export.export_with_fallback`): a batch split into a fixed number of pieces (a
classifier-free-guidance wrapper's ``eps.chunk(2)`` after ``torch.cat([x, x])``) is named, with slicing as the
fix."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn

from kiln.stages.export.torch_export import _batch_split, export_with_fallback

FIXED_BATCH = "it fixed input 'sample' axis 0 (batch), which export.dynamic_batch makes dynamic"


def test_a_fixed_batch_with_no_line_named_speaks_of_a_batch_split() -> None:
    said = _batch_split(FIXED_BATCH)
    assert "chunk, split or unbind over axis 0" in said and "eps[:B], eps[B:]" in said, said
    assert ", at " not in said  # fixed_places reads the line torch named after ", at "
    assert _batch_split("it fixed input 'x' axis 2 (time), which signature.dynamic_axes makes dynamic") == ""
    assert _batch_split("unsupported op aten::foo") == ""


class _Guided(nn.Module):
    """Classifier-free guidance: the batch doubled, the model run once, the two halves taken apart by chunk(2)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = self.lin(torch.cat([x, x]))
        uncond, cond = eps.chunk(2)
        return uncond + 2 * (cond - uncond)


@pytest.mark.slow  # torch.export traces the model before the TorchScript exporter runs (about 5 s)
def test_the_fallback_warning_for_a_chunked_batch_says_to_slice(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kiln.export"):
        _, refused = export_with_fallback(_Guided(), torch.randn(3, 4), tmp_path / "m.onnx")
    assert refused.startswith("it fixed input 'input' axis 0 (batch)"), refused
    assert "eps.chunk(2)" in refused and "eps[:B], eps[B:]" in refused, refused
