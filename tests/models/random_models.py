"""Tiny stochastic models as research code writes them, for the checks that refuse random draws at inference: a
VAE that samples ``z = mu + scale * eps * std`` in eval mode too, an MC-dropout head, a dropout that follows the
mode, a forward that keeps a call counter in a plain attribute, noise at a scale that starts at zero, and a model of
one row a call; with autoencoder data (targets: the inputs)."""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kiln.core.data import DatasetSplits


class Sampling(nn.Module):
    """``how``: ``randn`` (a VAE's sampling, noise times ``scale``), ``mean`` (the same VAE returning mu: no draw),
    ``dropout`` (``F.dropout`` at rate ``scale`` with training=True), ``mode`` (training=self.training), or
    ``counter`` (the output scaled by a count of calls kept in ``self.calls``)."""

    def __init__(self, how: str = "randn", scale: float = 1.0) -> None:
        super().__init__()
        self.how, self.scale, self.calls = how, scale, 0
        self.mu, self.logvar, self.decode = nn.Linear(6, 4), nn.Linear(6, 4), nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        z = self.mu(x)
        if self.how == "randn":
            z = z + self.scale * torch.randn_like(z) * torch.exp(0.5 * self.logvar(x))
        elif self.how in ("dropout", "mode"):
            z = F.dropout(z, self.scale, training=self.how == "dropout" or self.training)
        elif self.how == "counter":
            self.calls += 1
            z = z * self.calls
        return {"image": self.decode(z)}


def sampling(how: str = "randn", scale: float = 1.0) -> nn.Module:
    torch.manual_seed(0)  # the same weights for every call: engines and references of one model
    return Sampling(how, scale)


class OneRow(nn.Module):
    """A model of one row a call, as code written for a batch of one is: its forward flattens the input to
    ``[1, 6]`` (two rows are an error)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"y": self.fc(x.reshape(1, 6))}


def one_row() -> nn.Module:
    torch.manual_seed(0)
    return OneRow()


class ZeroNoise(nn.Module):
    """StyleGAN's noise input: ``h + self.weight * torch.randn_like(h)`` in eval mode too, the weight starting at
    zero, so that the outputs agree from call to call until training moves it; ``dropout``: an ``nn.Dropout`` (no
    draw in eval mode) instead of the noise."""

    def __init__(self, dropout: bool = False) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(6, 4), nn.Linear(4, 6)
        self.weight = nn.Parameter(torch.zeros(4))
        self.drop = nn.Dropout(0.5) if dropout else None

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.fc(x)
        h = self.drop(h) if self.drop is not None else h + self.weight * torch.randn_like(h)
        return {"image": self.out(h)}


def zero_noise(dropout: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return ZeroNoise(dropout)


def load() -> DatasetSplits:
    """64 rows of 6 features, each its own target (an autoencoder's)."""
    x = torch.rand(64, 6, generator=torch.Generator().manual_seed(0))
    return DatasetSplits(x[:48], x[:48].clone(), x[48:], x[48:].clone())


def export_torchscript(model: nn.Module, path: Path, output: str = "image", rows: int | None = None) -> Path:
    """``model`` in eval mode as an ONNX file exported elsewhere, by the TorchScript exporter (input ``x``, output
    ``output``; a dynamic batch, or ``rows`` fixed)."""
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model.eval(),
            (torch.rand(rows or 2, 6),),
            f,
            dynamo=False,
            input_names=["x"],
            output_names=[output],
            dynamic_axes=None if rows else {"x": {0: "batch"}, output: {0: "batch"}},
        )
    path.write_bytes(f.getvalue())
    return path
