"""An ONNX Runtime CPU engine slower than PyTorch whose graph holds DFT nodes (a Fourier layer's torch.fft) says
they are a likely cause, with the modules that made them; an engine on another device does not."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from kiln.stages.validate.stage import behind_pytorch, slow_op_note
from tests.stages.validate.test_loop_note import engine_of, slower


class Spectral(nn.Module):
    """A Fourier Neural Operator's spectral layer: real FFT over the grid, the low modes weighted, inverse FFT."""

    def __init__(self, channels: int = 4, modes: int = 3) -> None:
        super().__init__()
        self.modes = modes
        self.weight = nn.Parameter(torch.randn(channels, channels, modes, modes) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spec = torch.fft.rfft2(x)
        low = spec[:, :, : self.modes, : self.modes]
        mixed = torch.einsum("bixy,ioxy->boxy", low.real, self.weight)
        kept = torch.zeros_like(spec.real)
        kept[:, :, : self.modes, : self.modes] = mixed
        return torch.fft.irfft2(torch.complex(kept, torch.zeros_like(kept)), s=x.shape[-2:])


class FNO(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.spectral = Spectral()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.spectral(x)


def test_a_slow_ort_cpu_engine_names_its_dft_nodes(tmp_path: Path) -> None:
    torch.manual_seed(0)
    export, engine = engine_of(FNO(), torch.randn(2, 4, 8, 8), tmp_path)
    [note] = behind_pytorch([slower("ort")], {"32": "ort"}, cause=lambda e: slow_op_note(e, engine, export)).values()
    assert "runs at 0.05x PyTorch eager" in note
    assert "ort's graph holds" in note and "DFT nodes (made by Spectral modules spectral)" in note
    assert "pocketfft" in note
    on_gpu = slower("ort")
    on_gpu.device = "cuda"  # ONNX Runtime's CUDA DFT is no such kernel: nothing said
    assert slow_op_note(on_gpu, engine, export) == ""
