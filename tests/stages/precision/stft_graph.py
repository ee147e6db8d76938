"""A keyword spotter that computes its log-mel spectrogram inside ``forward`` (``torch.stft(center=True)`` on raw
audio ``[batch, samples]``), exported by ``torch.onnx.export`` (dynamo) with a dynamic ``samples`` axis: onnx's
and ONNX Runtime's shape inference give the exported STFT (a reflect Pad, then a Reshape to a size computed from
the input's) no shape, nor any node after it."""

from __future__ import annotations

import contextlib
import io
import warnings
from pathlib import Path

import onnx
import torch
from onnxruntime.quantization import quantize_dynamic
from torch import nn

N_FFT, HOP, MELS, CLASSES = 64, 32, 32, 3
SAMPLES = 256  # the size the audit counts at: 9 frames of 64 after the centring pad


class Spotter(nn.Module):
    """STFT -> magnitude -> mel projection (a MatMul on a [bins, mels] matrix) -> log -> Conv2d -> pool ->
    Linear. The mel matrix (33 x 32 floats) is over the 4 KB above which a light copy of the graph stubs a weight;
    the head, after a pool and a flatten, is sized by shape inference whatever the STFT's shape."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("window", torch.hann_window(N_FFT))
        self.register_buffer("mel", torch.rand(N_FFT // 2 + 1, MELS))
        self.conv = nn.Conv2d(1, 16, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(16, CLASSES)

    def forward(self, audio: torch.Tensor) -> torch.Tensor:
        spec = torch.stft(audio, N_FFT, HOP, window=self.window, center=True, return_complex=True).abs()
        logmel = torch.log(torch.matmul(spec.transpose(1, 2), self.mel) + 1e-6)
        return self.head(self.pool(torch.relu(self.conv(logmel.unsqueeze(1)))).flatten(1))


def export_spotter(path: Path) -> Path:
    """The spotter exported to ``path`` (input ``audio [batch, samples]``, output ``y``), its parameters in an
    external data file beside it, seeded; unoptimized, as Kiln's export stage writes it (its window then reaches
    the STFT through a pad to a length shape inference does not compute)."""
    torch.manual_seed(0)
    axes = {"audio": {0: torch.export.Dim("batch", max=64), 1: torch.export.Dim("samples", min=64, max=4096)}}
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):  # the exporter's progress lines
        warnings.simplefilter("ignore")
        torch.onnx.export(
            Spotter().eval(),
            (torch.randn(2, SAMPLES),),
            str(path),
            input_names=["audio"],
            output_names=["y"],
            dynamic_shapes=axes,
            dynamo=True,
            external_data=True,
            optimize=False,
        )
    return path


def int8_spotter(fp32: Path, path: Path) -> Path:
    """ONNX Runtime's dynamic INT8 quantization of the spotter (its CPU INT8 graph: ConvInteger, MatMulInteger)
    with the mel MatMul kept in float, as the precision stage's fallback keeps it; the STFT runs in float."""
    mel = [n.name for n in onnx.load(str(fp32), load_external_data=False).graph.node if n.op_type == "MatMul"]
    quantize_dynamic(str(fp32), str(path), op_types_to_quantize=["Conv", "MatMul", "Gemm"], nodes_to_exclude=mel)
    return path
