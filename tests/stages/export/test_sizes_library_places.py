"""The size check's error where a library's module fixed a size: ONNX Runtime's reason whole (not cut inside the
C++ signature its message puts first), and the library's lines the dynamo exporter found fixing the size named in
the fix, which no line of the user's code is."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from kiln.core import user_errors
from kiln.core.data import DatasetSplits
from kiln.core.errors import ModelError
from kiln.core.onnx_io import ort_session
from kiln.stages.export.sizes import _library_fix, check_validated_sizes
from kiln.stages.export.torch_export import export_with_fallback

LIBRARY = '''
import torch
from torch import nn


class AddPositions(nn.Module):
    """A library's position table made from a Python list over the length, as Funnel's relative positions are."""

    def forward(self, x):  # x: [B, L, C]
        positions = list(range(x.shape[1]))  # FIXES
        return x + torch.tensor(positions, dtype=x.dtype)[None, :, None]
'''
FIXES_AT = (
    f"kiln_probe_positions.py:{LIBRARY.splitlines().index('        positions = list(range(x.shape[1]))  # FIXES') + 1}"
)


# A library's module that reads the length as a Python number from a tensor: the TorchScript exporter's trace warns
# of that line and keeps the example's length
TRACED_LIBRARY = LIBRARY.replace(
    "positions = list(range(x.shape[1]))  # FIXES",
    "positions = list(range(int((x[0, :, 0] * 0 + 1).sum())))  # FIXES",
)


@pytest.fixture
def library(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> object:
    """:data:`LIBRARY` imported from a folder that counts as installed libraries (as site-packages does)."""
    return _installed(tmp_path, monkeypatch, LIBRARY)


@pytest.fixture
def traced_library(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> object:
    """:data:`TRACED_LIBRARY`, installed as :func:`library` is."""
    return _installed(tmp_path, monkeypatch, TRACED_LIBRARY)


def _installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str) -> object:
    folder = tmp_path / "site-packages"
    folder.mkdir()
    (folder / "kiln_probe_positions.py").write_text(source)
    dirs = user_errors._library_dirs()
    monkeypatch.setattr(user_errors, "_library_dirs", lambda: (*dirs, str(folder.resolve()) + os.sep))
    spec = importlib.util.spec_from_file_location("kiln_probe_positions", folder / "kiln_probe_positions.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Positioned(nn.Module):
    """The user's model around the library's position table."""

    def __init__(self, library: object) -> None:
        super().__init__()
        self.positions = library.AddPositions()  # type: ignore[attr-defined]
        self.head = nn.Linear(2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.positions(x)).mean(1)


def test_the_size_check_says_onnx_runtimes_reason_and_the_library_line(tmp_path: Path, library: object) -> None:
    """Exported at 16 steps (the TorchScript exporter's graph: the dynamo exporter fixed the length in the library),
    validated at 8: ONNX Runtime's broadcast error is said to its end, and the fix names the library's line."""
    model, x, axes = Positioned(library).eval(), torch.randn(12, 16, 2), {"input": {1: "seq"}}
    data, path = DatasetSplits(x[:8], None, x[8:], None), tmp_path / "m.onnx"
    _, dynamo = export_with_fallback(model, x[:2], path, 18, True, axes)
    assert dynamo.endswith(f", at {FIXES_AT}"), dynamo
    with pytest.raises(ModelError, match="does not compute the model at seq=8") as caught:
        check_validated_sizes(
            model, path, ort_session(path), data, ["input"], axes, {"seq": [8, 16]}, 1e-4, 1e-5, dynamo=dynamo
        )
    assert "Attempting to broadcast an axis by a dimension other than 1. 8 by 16)" in caught.value.message
    assert "onnxruntime_src" not in caught.value.message
    assert (caught.value.hint or "").startswith(
        f"no line of your code was found fixing it; a library's module did, at {FIXES_AT}, where torch.export found "
        "the size fixed"
    ), caught.value.hint


def test_the_fix_names_the_places_the_funnel_export_found() -> None:
    said = _library_fix({"seq": [32]}, "modeling_funnel.py:152")
    assert "a library's module did, at modeling_funnel.py:152, where torch.export found the size fixed" in said
    assert "e.g. {seq: [32]} (where it does)" in said
    assert "a library's module may have" in _library_fix({"seq": [32]})


def test_the_fix_names_the_library_line_the_torchscript_exporter_traced(tmp_path: Path, traced_library: object) -> None:
    """Exported at opset 17 (the TorchScript exporter only, whose warning names the library's line it traced as a
    Python number), validated at another length: the fix names that line, as the warning did."""
    model, x, axes = Positioned(traced_library).eval(), torch.randn(12, 16, 2), {"input": {1: "seq"}}
    data, path = DatasetSplits(x[:8], None, x[8:], None), tmp_path / "m.onnx"
    _, dynamo = export_with_fallback(model, x[:2], path, 17, True, axes)
    assert dynamo == ""
    with pytest.raises(ModelError, match="does not compute the model at seq=8") as caught:
        check_validated_sizes(model, path, ort_session(path), data, ["input"], axes, {"seq": [8, 16]}, 1e-4, 1e-5)
    assert (caught.value.hint or "").startswith(
        f"no line of your code was found fixing it; a library's module may have, at {FIXES_AT}, where the "
        "TorchScript exporter read a tensor's value or size as a Python number"
    ), caught.value.hint
