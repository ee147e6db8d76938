"""Where both exporters fail, or the graph is wrong at a size, the error names the cause the user can act on: the
line that fixed a dynamic axis (a size given to numpy) even when the TorchScript exporter then fails on an op of its
own; complex values, which ONNX has no type for, with their rewrite as real ones; and, for a branch on the size in a
library's module, sizes to validate where the graph computes the model."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from torch import nn

from kiln.cli import main
from kiln.core import user_errors
from kiln.core.data import DatasetSplits
from kiln.core.errors import ModelError
from kiln.core.onnx_io import ort_session
from kiln.stages.export.sizes import check_validated_sizes
from kiln.stages.export.torch_export import export_onnx
from tests.core.test_ownership import one_error

HERE = "tests.stages.export.test_export_failure_causes"


class GridSpectrum(nn.Module):
    """Paper code's FNO lifting: a coordinate grid made with numpy from the height (a Python int), then a spectrum
    (rfft2, which the TorchScript exporter cannot write)."""

    def __init__(self) -> None:
        super().__init__()
        self.lift = nn.Linear(2, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, H, W, 1]
        h = x.shape[1]
        grid = torch.tensor(np.linspace(0, 1, h), dtype=torch.float32).reshape(1, h, 1, 1).expand_as(x)  # NUMPY
        y = self.lift(torch.cat([x, grid], -1)).permute(0, 3, 1, 2)
        return torch.fft.irfft2(torch.fft.rfft2(y), s=(y.shape[-2], y.shape[-1]))


NUMPY_AT = f"test_export_failure_causes.py:{GridSpectrum.forward.__code__.co_firstlineno + 2}"


class ComplexWeights(nn.Module):
    """FNO's spectral convolution as paper code writes it: complex weights, an einsum on the lowest modes written
    into a slice of a zero spectrum."""

    def __init__(self, channels: int = 2, modes: int = 3) -> None:
        super().__init__()
        self.modes = modes
        self.weight = nn.Parameter(torch.rand(channels, channels, modes, modes, dtype=torch.cfloat))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, C, H, W]
        f, m = torch.fft.rfft2(x), self.modes
        out = torch.zeros(x.shape[0], x.shape[1], x.shape[-2], x.shape[-1] // 2 + 1, dtype=torch.cfloat)
        out[:, :, :m, :m] = torch.einsum("bixy,ioxy->boxy", f[:, :, :m, :m], self.weight)
        return torch.fft.irfft2(out, s=(x.shape[-2], x.shape[-1]))


def grid_spectrum() -> nn.Module:
    return GridSpectrum()


def complex_weights() -> nn.Module:
    return ComplexWeights()


def _export(tmp_path: Path, factory: str, shape: str, axes: str):
    args = ["export", "--model", f"{HERE}:{factory}", "--input-shape", shape, "-o", str(tmp_path / "m.onnx")]
    return CliRunner().invoke(main, [*args, "--set", f"signature.dynamic_axes={{input: {axes}}}"])


def test_an_axis_the_dynamo_exporter_fixed_is_the_fix_though_the_fallback_fails_on_an_op(tmp_path: Path) -> None:
    """The dynamo exporter exports but fixes h (numpy's linspace took it as a Python int); the TorchScript exporter
    then fails on aten::fft_rfft2. The fix is about the size, at the numpy line, not an op ONNX cannot express."""
    result = _export(tmp_path, "grid_spectrum", "16x16x1", "{1: h, 2: w}")
    one_error(result, "it fixed input 'input' axis 1 (h)", NUMPY_AT, "fix: in forward() at", "keep sizes in forward")
    assert "cannot express" not in result.output


def test_complex_weights_are_said_as_complex_with_their_real_rewrite(tmp_path: Path) -> None:
    """The export runs without autograd (which refused slice_scatter on complex outputs, a cause with no fix), and
    the error says ONNX has no complex tensors and how to write the weights and FFTs with real ones."""
    result = _export(tmp_path, "complex_weights", "2x8x8", "{2: h, 3: w}")
    one_error(result, "ONNX has no complex tensors", "'weight' (complex64)", "torch.view_as_real", "two real tensors")
    assert "automatic differentiation" not in result.output and "cannot express" not in result.output


LIBRARY = '''
import torch
from torch import nn


class PadToPatches(nn.Module):
    """A library's patch embedding: pads the length to a multiple of the patch only where it is not one."""

    def __init__(self, patch):
        super().__init__()
        self.patch = patch

    def forward(self, x):  # x: [B, L, C]
        length = x.shape[1]
        if length % self.patch != 0:
            x = torch.cat([x[:, :1].repeat(1, self.patch - length % self.patch, 1), x], dim=1)
        return x.permute(0, 2, 1).unfold(-1, self.patch, self.patch)
'''


@pytest.fixture
def library(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> object:
    """:data:`LIBRARY` imported from a folder that counts as installed libraries (as site-packages does)."""
    folder = tmp_path / "site-packages"
    folder.mkdir()
    (folder / "kiln_probe_patches.py").write_text(LIBRARY)
    dirs = user_errors._library_dirs()
    monkeypatch.setattr(user_errors, "_library_dirs", lambda: (*dirs, str(folder.resolve()) + os.sep))
    spec = importlib.util.spec_from_file_location("kiln_probe_patches", folder / "kiln_probe_patches.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert not user_errors.is_user_file(str(folder / "kiln_probe_patches.py"))
    return module


class Patched(nn.Module):
    """The user's model around the library's patch embedding (patches of 32 steps)."""

    def __init__(self, library: object) -> None:
        super().__init__()
        self.patches = library.PadToPatches(32)  # type: ignore[attr-defined]
        self.embed, self.head = nn.Linear(32, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.embed(self.patches(x))).mean((1, 2)))


def test_a_branch_in_a_library_gets_signature_shapes_where_the_graph_computes_the_model(
    tmp_path: Path, library: object
) -> None:
    """Data at 64 (no padding: the graph has none), validated at 40 and 64: the graph is wrong at 40. No line of the
    user's code fixed the size (the branch is the library's, which the user cannot edit): the fix offers
    signature.shapes at the data's size, where the graph computes the model, before the advice for their own code."""
    model, x, axes = Patched(library).eval(), torch.randn(12, 64, 2), {"input": {1: "seq"}}
    data, path = DatasetSplits(x[:8], None, x[8:], None), tmp_path / "m.onnx"
    export_onnx(model, x[:2], path, dynamic_axes=axes)
    with pytest.raises(ModelError, match="does not compute the model at seq=40") as caught:
        check_validated_sizes(model, path, ort_session(path), data, ["input"], axes, {"seq": [40, 64]}, 1e-4, 1e-5)
    hint = caught.value.hint or ""
    assert hint.startswith("no line of your code was found fixing it; a library's module may have"), hint
    assert "signature.shapes sizes on the side of that branch where the graph computes the model, e.g. {seq: [64]}" in (
        hint
    )
    assert "kiln_probe_patches" not in caught.value.message  # no library line is said as the user's
