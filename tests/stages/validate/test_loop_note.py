"""An ONNX engine slower than PyTorch whose graph holds Loop nodes says so, with the modules that made them (an
``nn.EmbeddingBag`` exports as a Loop over the bags, which ONNX Runtime runs op by op)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from kiln.core.records import EngineValidation
from kiln.stages.engines.config import BuildConfig
from kiln.stages.engines.onnxruntime.config import OnnxRuntimeConfig
from kiln.stages.engines.stage import build_engine
from kiln.stages.export.torch_export import export_onnx
from kiln.stages.validate.stage import behind_pytorch, loop_note
from tests.user_models import BagModel


def engine_of(model: nn.Module, sample: torch.Tensor, tmp_path: Path) -> tuple[Path, Path]:
    """The exported graph of ``model`` and an ONNX Runtime CPU FP32 engine built from it."""
    export = tmp_path / "model.onnx"
    export_onnx(model.eval(), sample, export)
    cfg = BuildConfig(backends=["onnxruntime"], onnxruntime=OnnxRuntimeConfig())
    build_engine(export, tmp_path / "engine", "onnxruntime", "cpu", "fp32", cfg, tmp_path / "cache", name="ort")
    return export, tmp_path / "engine"


def slower(name: str) -> EngineValidation:
    """A validated engine at 0.05x PyTorch eager at batch 32, beyond the timing's noise."""
    return EngineValidation(
        name=name, backend="onnxruntime", precision="fp32", device="cpu", status="validated", passed=True,
        speedups={"eager-cpu": {"32": 0.05}}, speedup_ci={"eager-cpu": {"32": (0.03, 0.11)}},
    )  # fmt: skip


def test_a_slow_engine_names_its_loops_and_the_modules_that_made_them(tmp_path: Path) -> None:
    torch.manual_seed(0)
    export, engine = engine_of(BagModel(), torch.randint(0, 17, (2, 64)), tmp_path)
    [note] = behind_pytorch([slower("ort")], {"32": "ort"}, cause=lambda e: loop_note(engine, export)).values()
    assert "runs at 0.05x PyTorch eager" in note  # the speed note as before, then its likely cause
    assert "ort's graph holds 1 Loop node (made by EmbeddingBag modules bag)" in note
    assert note.endswith("nn.EmbeddingBag exports as a Loop, an nn.Embedding followed by a sum over the bag does not")
    # without the export's metadata, the count alone
    assert loop_note(engine, tmp_path / "missing.onnx").startswith("ort's graph holds 1 Loop node, which ONNX Runtime")


def test_an_engine_without_loops_says_nothing_more(tmp_path: Path) -> None:
    export, engine = engine_of(nn.Linear(8, 4), torch.randn(2, 8), tmp_path)
    assert loop_note(engine, export) == ""
    [note] = behind_pytorch([slower("ort")], {"32": "ort"}, cause=lambda e: loop_note(engine, export)).values()
    assert note.endswith("add torch to build.backends with build.torch.devices: [cpu]")
