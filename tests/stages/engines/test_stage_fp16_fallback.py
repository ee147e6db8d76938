"""An ORT FP16 engine of a graph with sequences (an nn.EmbeddingBag export: a Loop over sequences) is converted from
the FP32 graph with its sequence ops kept FP32, as the precision stage keeps them, instead of failing the build stage
(or falling back to the precision stage's graph)."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from kiln.calibration.config import CalibrationConfig
from kiln.core.onnx_io import load_onnx
from kiln.core.records import PrecisionVariant, Variants
from kiln.pipeline.config import config_from_dict
from kiln.stages.engines import stage
from kiln.stages.engines.backend import read_metadata
from kiln.stages.export.torch_export import export_onnx
from kiln.stages.precision.config import FallbackConfig, FP16Config
from kiln.stages.precision.stage import variant_record
from kiln.stages.precision.variants import Source, build_fp16
from tests.conftest import stage_context
from tests.user_models import BagModel


def test_ort_fp16_engine_of_an_embedding_bag(tmp_path: Path) -> None:
    torch.manual_seed(0)
    export_onnx(BagModel(), torch.randint(0, 17, (2, 64)), tmp_path / "export.onnx")
    root = tmp_path / "precision"
    x = np.random.default_rng(0).integers(0, 17, (64, 64)).astype(np.int64)
    src = Source.prepare(load_onnx(tmp_path / "export.onnx"), root / "fp32" / "model.onnx", [x[:32]], None)
    fp16 = build_fp16(
        src, root / "fp16" / "model.onnx", FP16Config(), FallbackConfig(samples=64), x, CalibrationConfig(cache=False)
    )
    Variants(variants={"fp32": PrecisionVariant(path="fp32/model.onnx"), "fp16": variant_record(fp16)}).write(
        root / "variants.json"
    )
    # CUDA engines (built here): the CPU provider's FP16 engine would compute in FP32, and the audit refuses it
    build = {"backends": ["onnxruntime"], "onnxruntime": {"devices": ["cuda"]}}
    cfg = config_from_dict({"build": build, "validate": {"batch_sizes": [1, 8]}})
    assert cfg.build.onnxruntime.fp16_source == "fp32_graph"  # the default: ORT converts the FP32 graph itself
    (tmp_path / "out").mkdir()
    ctx = stage_context("build", cfg, tmp_path, tmp_path / "out", {"precision": root}, log=logging.getLogger("t"))
    result = stage.run(ctx)  # before: ORT's converter cast a sequence to FP16, and the graph did not load
    assert [e.name for e in result.engines] == ["onnxruntime-cuda-fp32", "onnxruntime-cuda-fp16"]
    meta16, meta32 = (read_metadata(ctx.out / n) for n in ("onnxruntime-cuda-fp16", "onnxruntime-cuda-fp32"))
    assert meta16.source.sha256 == meta32.source.sha256  # converted from the FP32 graph, no fallback
