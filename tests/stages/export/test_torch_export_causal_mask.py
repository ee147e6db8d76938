"""An nn.TransformerDecoder given a float causal mask without tgt_is_causal: torch reads the mask's values to tell
whether it is causal, which the dynamo exporter cannot export; Kiln names that flag as the fix."""

from __future__ import annotations

import inspect
from pathlib import Path

import torch
from torch import nn

from kiln.stages.export.torch_export import export_with_fallback


class MaskedDecoder(nn.Module):
    """One tiny decoder layer over a causal mask of -inf above the diagonal, built at the input's length."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dec = nn.TransformerDecoder(nn.TransformerDecoderLayer(8, 2, 16, 0.0, batch_first=True), 1)

    def forward(self, tgt: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        n = tgt.shape[1]
        return self.dec(tgt, memory, tgt_mask=torch.triu(torch.full((n, n), float("-inf")), diagonal=1))


def test_a_decoders_causal_mask_check_names_tgt_is_causal(tmp_path: Path) -> None:
    example = {"tgt": torch.randn(2, 5, 8), "memory": torch.randn(2, 3, 8)}
    _, refused = export_with_fallback(MaskedDecoder(), example, tmp_path / "m.onnx", dynamic_axes={"tgt": {1: "seq"}})
    assert "nn.TransformerDecoder reads the mask's values" in refused
    assert "pass tgt_is_causal=True with the causal mask" in refused
    line = inspect.getsourcelines(MaskedDecoder.forward)[1] + 2  # its return line: the one the later errors name
    assert refused.endswith(f"test_torch_export_causal_mask.py:{line})")
