"""The extra INT8 graph for ONNX Runtime CPU: static uint8 activations for CNNs, dynamic quantization for
Transformers (``calibration.ort_cpu_scheme``), same function as the FP32 graph."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from kiln.core.onnx_io import ort_session
from kiln.models.registry import build_model
from kiln.stages.export.torch_export import export_onnx
from tests.stages.precision.test_precision_stage import TRANSFORMER, _run


@pytest.fixture(scope="module")
def cnn_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("optimize-cnn")
    torch.manual_seed(0)
    export_onnx(build_model("cnn", {"width": 8, "depth": 2}), torch.rand(2, 1, 8, 8), folder / "model.onnx")
    return folder


def _zero_point_types(path: Path) -> set[int]:
    model = onnx.load(str(path))
    inits = {i.name: i for i in model.graph.initializer}
    return {
        inits[n.input[2]].data_type
        for n in model.graph.node
        if n.op_type == "QuantizeLinear" and len(n.input) > 2 and n.input[2] in inits
    }


def test_ort_cpu_graph_is_uint8_and_agrees(tmp_path: Path, cnn_dir: Path) -> None:
    overrides = {"model.name": "cnn", "model.params": {"width": 8, "depth": 2}, "precision.variants": ["fp32", "int8"]}
    variants, summary = _run(tmp_path, cnn_dir, **overrides)
    assert set(summary["first_divergence"]) == {"int8", "int8 onnxruntime-cpu"}  # each graph's curve, plotted
    root = tmp_path / "precision"
    ort_path = root / variants["int8"].backend_paths["onnxruntime-cpu"]
    assert variants["int8"].report["ort_cpu"]["scheme"] == "static"  # auto: the graph has convolutions
    assert _zero_point_types(ort_path) == {onnx.TensorProto.UINT8}
    assert _zero_point_types(root / variants["int8"].path) == {onnx.TensorProto.INT8}  # TensorRT's form
    assert _cosine_to_fp32(root, variants, ort_path) > 0.99


def _cosine_to_fp32(root: Path, variants: dict, path: Path) -> float:
    x = np.random.default_rng(0).random((64, 1, 8, 8), dtype=np.float32)
    ref, got = (ort_session(p).run(None, {"input": x})[0] for p in (root / variants["fp32"].path, path))
    return float((ref * got).sum() / np.linalg.norm(ref) / np.linalg.norm(got))


@pytest.fixture(scope="module")
def transformer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # What the precision stage gets: the optimize stage's graph (weights folded into constants, so dynamic
    # quantization sees constant MatMul weights, as it does in a run).
    from kiln.core.onnx_io import save_onnx
    from kiln.stages.optimize.config import OptimizeConfig
    from kiln.stages.optimize.stage import optimize_model

    folder = tmp_path_factory.mktemp("optimize-transformer")
    torch.manual_seed(0)
    exported = export_onnx(
        build_model("transformer", TRANSFORMER["model.params"]), torch.rand(2, 1, 8, 8), folder / "exported.onnx"
    )
    save_onnx(optimize_model(exported, OptimizeConfig())[0], folder / "model.onnx")
    return folder


def _ops(path: Path) -> list[str]:
    return [n.op_type for n in onnx.load(str(path)).graph.node]


def test_transformer_ort_cpu_graph_is_dynamic_and_keeps_float_nodes(tmp_path: Path, transformer_dir: Path) -> None:
    keep = next(n.name for n in onnx.load(str(transformer_dir / "model.onnx")).graph.node if n.op_type == "MatMul")
    variants, summary = _run(
        tmp_path, transformer_dir, **{"precision.variants": ["fp32", "int8"], "calibration.exclude_nodes": [keep]}
    )
    root = tmp_path / "precision"
    ort_path = root / variants["int8"].backend_paths["onnxruntime-cpu"]
    assert variants["int8"].report["ort_cpu"]["scheme"] == summary["variants"]["int8"]["ort_cpu_scheme"] == "dynamic"
    assert variants["int8"].report["ort_cpu"]["integer_matmuls"] > 0
    ops = _ops(ort_path)
    # int8 weights, activation scales computed per batch: no calibrated QuantizeLinear on activations
    assert "DynamicQuantizeLinear" in ops and "MatMulInteger" in ops and "QuantizeLinear" not in ops
    kept = [n for n in onnx.load(str(ort_path)).graph.node if n.name == keep]
    assert [n.op_type for n in kept] == ["MatMul"]
    assert "QuantizeLinear" in _ops(root / variants["int8"].path)  # TensorRT still gets the Q/DQ graph
    assert _cosine_to_fp32(root, variants, ort_path) > 0.99


def test_transformer_ort_cpu_scheme_can_be_forced_static(tmp_path: Path, transformer_dir: Path) -> None:
    variants, _ = _run(
        tmp_path, transformer_dir, **{"precision.variants": ["fp32", "int8"], "calibration.ort_cpu_scheme": "static"}
    )
    ort_path = tmp_path / "precision" / variants["int8"].backend_paths["onnxruntime-cpu"]
    assert variants["int8"].report["ort_cpu"]["scheme"] == "static" and "DynamicQuantizeLinear" not in _ops(ort_path)
    assert _zero_point_types(ort_path) == {onnx.TensorProto.UINT8}


def test_ort_cpu_graph_can_be_turned_off(tmp_path: Path, cnn_dir: Path) -> None:
    overrides = {
        "model.name": "cnn",
        "model.params": {"width": 8, "depth": 2},
        "precision.variants": ["int8"],
        "calibration.ort_cpu_graph": False,
    }
    variants, _ = _run(tmp_path, cnn_dir, **overrides)
    assert not variants["int8"].backend_paths


def test_no_cache_leaves_no_temporary_folders(tmp_path: Path, cnn_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tempfile

    # a temporary folder of this test's own: other tests' calibrations (other workers) make theirs in /tmp meanwhile
    private = tmp_path / "tmp"
    private.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(private))
    overrides = {
        "model.name": "cnn",
        "model.params": {"width": 8, "depth": 2},
        "precision.variants": ["int8"],
        "calibration.cache": False,
    }
    variants, summary = _run(tmp_path, cnn_dir, **overrides)
    assert summary["calibration_cache"] is None and "int8" in variants
    assert not list(private.glob("kiln-calib-*"))


def test_dynamic_graph_keeps_an_excluded_gemm_float(tmp_path: Path, transformer_dir: Path) -> None:
    # quantize_dynamic rewrites Gemm into "<name>_MatMul" + "<name>_Add" before quantizing, so excluding the
    # Gemm by name or op type only works under the new name.
    (head,) = [n.name for n in onnx.load(str(transformer_dir / "model.onnx")).graph.node if n.op_type == "Gemm"]
    variants, _ = _run(
        tmp_path, transformer_dir, **{"precision.variants": ["fp32", "int8"], "calibration.exclude_op_types": ["Gemm"]}
    )
    ort_path = tmp_path / "precision" / variants["int8"].backend_paths["onnxruntime-cpu"]
    ops = {n.name: n.op_type for n in onnx.load(str(ort_path)).graph.node}
    assert ops[f"{head}_MatMul"] == "MatMul" and "MatMulInteger" in ops.values()


def test_auto_is_static_when_matmul_is_not_quantized(tmp_path: Path, transformer_dir: Path) -> None:
    """A transformer's INT8 without its MatMuls: the static scheme, and so little left in INT8 that its graph is
    marked not made (no engine read from it could be labelled INT8), said with its share; the torch backend's INT8
    engines, compiled from the PyTorch model, could still be built."""
    from kiln.calibration.config import CalibrationConfig
    from kiln.calibration.quantize import ort_cpu_scheme
    from kiln.core.onnx_io import load_onnx

    cfg = CalibrationConfig(exclude_op_types=["MatMul"])
    assert ort_cpu_scheme(load_onnx(transformer_dir / "model.onnx"), cfg) == "static"
    variants, summary = _run(
        tmp_path,
        transformer_dir,
        **{"precision.variants": ["fp32", "int8"], "calibration.exclude_op_types": ["MatMul"]},
    )
    assert "of its FLOPs run in int8" in variants["int8"].unmade and not variants["int8"].backend_paths
    assert summary["variants"]["int8"]["pytorch_model"]  # report.md says the torch backend's engines still build


def test_dynamic_without_matmul_is_a_config_error() -> None:
    from kiln.core.errors import ConfigError
    from kiln.pipeline.config import config_from_dict

    with pytest.raises(ConfigError, match="ort_cpu_scheme 'dynamic' quantizes MatMul"):
        config_from_dict({"calibration": {"ort_cpu_scheme": "dynamic", "exclude_op_types": ["MatMul"]}})
