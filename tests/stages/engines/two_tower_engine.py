"""A tiny two-tower model (a CLIP's shape: texts and images in counts of their own), exported as a user exports it,
with a name per first axis (``texts``, ``images``) on its inputs and outputs, and built as an ONNX Runtime CPU
engine."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from kiln.core.records import EngineMetadata
from kiln.stages.engines.config import BuildConfig
from kiln.stages.engines.onnxruntime.config import OnnxRuntimeConfig
from kiln.stages.engines.stage import build_engine

FEATURES, PIXELS, EMBED = 4, 6, 3
INPUTS, OUTPUTS = ["tokens", "pixels"], ["text_embeds", "image_embeds"]


class TwoTowers(nn.Module):
    """``tokens [texts, seq, 4]`` -> ``text_embeds [texts, 3]`` (a mean over the sequence, then a Linear);
    ``pixels [images, 6]`` -> ``image_embeds [images, 3]``: no op joins the towers."""

    def __init__(self) -> None:
        super().__init__()
        self.text = nn.Linear(FEATURES, EMBED)
        self.image = nn.Linear(PIXELS, EMBED)

    def forward(self, tokens: torch.Tensor, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.text(tokens.mean(1)), self.image(pixels)


def export_two_towers(path: Path) -> Path:
    """``torch.onnx.export`` of :class:`TwoTowers` with ``texts`` / ``images`` as first axes and ``seq`` dynamic."""
    torch.manual_seed(0)
    axes = {
        "tokens": {0: "texts", 1: "seq"},
        "pixels": {0: "images"},
        "text_embeds": {0: "texts"},
        "image_embeds": {0: "images"},
    }
    example = (torch.randn(3, 5, FEATURES), torch.randn(2, PIXELS))
    with warnings.catch_warnings():  # the TorchScript exporter's deprecation: it names outputs as dynamic_axes says
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(
            TwoTowers().eval(),
            example,
            str(path),
            input_names=INPUTS,
            output_names=OUTPUTS,
            dynamic_axes=axes,
            dynamo=False,
        )
    return path


def two_tower_feed(texts: int, images: int, seq: int = 5) -> dict[str, np.ndarray]:
    """Random inputs of ``texts`` texts and ``images`` images."""
    rng = np.random.default_rng(texts * 10 + images)
    return {
        "tokens": rng.standard_normal((texts, seq, FEATURES), dtype=np.float32),
        "pixels": rng.standard_normal((images, PIXELS), dtype=np.float32),
    }


def two_tower_engine(folder: Path) -> tuple[Path, EngineMetadata]:
    """The engine folder and its metadata, validated for seq from 2 to 8."""
    cfg = BuildConfig(backends=["onnxruntime"], onnxruntime=OnnxRuntimeConfig(autotune={"cpu": False}))
    graph = export_two_towers(folder / "two_towers.onnx")
    out = folder / "engine"
    meta = build_engine(graph, out, "onnxruntime", "cpu", "fp32", cfg, folder / "cache", axis_sizes={"seq": [2, 8]})
    return out, meta
