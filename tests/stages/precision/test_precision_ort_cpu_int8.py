"""The extra INT8 graph for ONNX Runtime CPU: uint8 asymmetric activations, same function as the FP32 graph."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from models import build_model
from pipeline.onnx_io import ort_session
from stages.export import export_onnx
from tests.stages.precision.test_precision_stage import _run


@pytest.fixture(scope="module")
def cnn_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("optimize-cnn")
    torch.manual_seed(0)
    export_onnx(build_model("cnn", {"width": 8, "depth": 2}), torch.rand(2, 1, 8, 8), folder / "model.onnx")
    return folder


def _zero_point_types(path: Path) -> set[int]:
    model = onnx.load(str(path))
    inits = {i.name: i for i in model.graph.initializer}
    return {inits[n.input[2]].data_type for n in model.graph.node
            if n.op_type == "QuantizeLinear" and len(n.input) > 2 and n.input[2] in inits}


def test_ort_cpu_graph_is_uint8_and_agrees(tmp_path: Path, cnn_dir: Path) -> None:
    overrides = {"model.name": "cnn", "model.params": {"width": 8, "depth": 2}, "precision.variants": ["fp32", "int8"]}
    variants, _ = _run(tmp_path, cnn_dir, **overrides)
    root = tmp_path / "precision"
    ort_path = root / variants["int8"]["backend_paths"]["onnxruntime-cpu"]
    assert _zero_point_types(ort_path) == {onnx.TensorProto.UINT8}
    assert _zero_point_types(root / variants["int8"]["path"]) == {onnx.TensorProto.INT8}  # TensorRT's form
    x = np.random.default_rng(0).random((64, 1, 8, 8), dtype=np.float32)
    ref, got = (ort_session(p).run(None, {"input": x})[0] for p in (root / variants["fp32"]["path"], ort_path))
    cos = float((ref * got).sum() / np.linalg.norm(ref) / np.linalg.norm(got))
    assert cos > 0.99


def test_ort_cpu_graph_can_be_turned_off(tmp_path: Path, cnn_dir: Path) -> None:
    overrides = {"model.name": "cnn", "model.params": {"width": 8, "depth": 2}, "precision.variants": ["int8"],
                 "calibration.ort_cpu_uint8": False}
    variants, _ = _run(tmp_path, cnn_dir, **overrides)
    assert "backend_paths" not in variants["int8"]


def test_no_cache_leaves_no_temporary_folders(tmp_path: Path, cnn_dir: Path) -> None:
    import glob

    before = set(glob.glob("/tmp/kiln-calib-*"))
    overrides = {"model.name": "cnn", "model.params": {"width": 8, "depth": 2}, "precision.variants": ["int8"],
                 "calibration.cache": False}
    variants, summary = _run(tmp_path, cnn_dir, **overrides)
    assert summary["calibration_cache"] is None and "int8" in variants
    assert set(glob.glob("/tmp/kiln-calib-*")) == before
