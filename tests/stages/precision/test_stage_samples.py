"""The precision stage saves calibration rows (calibration.npz) wherever the torch backend can build, FP32-only runs
included: its builds run the PyTorch model on them rather than on random inputs."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import numpy as np
import onnx
import torch

from kiln.calibration.feeds import FILE, load_feeds
from kiln.calibration.ranges import STATS
from kiln.core.records import Variants
from kiln.models.registry import build_model
from kiln.pipeline.config import config_from_dict
from kiln.pipeline.runner import load_dataset
from kiln.stages.export.torch_export import export_onnx
from kiln.stages.precision.stage import run
from tests.conftest import stage_context, tiny_config_dict

CNN = {"width": 8, "depth": 2}


def _run(workdir: Path, optimize: Path, **overrides: object) -> Path:
    cfg = config_from_dict(tiny_config_dict(**{"model.params": CNN, **overrides}))
    ctx = stage_context(
        "precision",
        cfg,
        workdir,
        workdir / "precision",
        {"optimize": optimize},
        load_dataset=partial(load_dataset, cfg),
    )
    ctx.out.mkdir(parents=True)
    run(ctx)
    return ctx.out


def test_fp32_only_with_the_torch_backend_saves_the_rows_a_build_runs(tmp_path: Path) -> None:
    """Only FP32 asked: the rows of the largest batch are saved from the dataset, and no variant is calibrated."""
    optimize = tmp_path / "optimize"
    optimize.mkdir()
    torch.manual_seed(0)
    export_onnx(build_model("cnn", CNN), torch.rand(2, 1, 8, 8), optimize / "model.onnx")
    before = STATS["calibrations"]
    out = _run(
        tmp_path,
        optimize,
        **{"precision.variants": ["fp32"], "build.backends": ["onnxruntime", "torch"], "signature.batch_sizes": [1, 8]},
    )
    assert STATS["calibrations"] == before and list(Variants.read(out / "variants.json", hint="").variants) == ["fp32"]
    name = onnx.load(str(optimize / "model.onnx")).graph.input[0].name
    feeds = load_feeds(out / FILE, [name])
    rows = np.concatenate([f[name] for f in feeds])
    assert rows.shape[1:] == (1, 8, 8) and len(rows) == 8 and rows.std() > 0
