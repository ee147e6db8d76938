"""FP8 (E4M3) Q/DQ graphs for TensorRT: made by ONNX Runtime's quantizer from distribution-calibrated ranges, judged
like INT8's, audited as FP8, and never built into an ONNX Runtime engine (it has no FP8 kernels)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import torch

from kiln.calibration.config import CalibrationConfig
from kiln.stages.engines.onnxruntime import _plan
from kiln.stages.engines.onnxruntime.config import OnnxRuntimeConfig
from kiln.stages.export.torch_export import export_onnx
from kiln.stages.precision.audit import audit_graph
from kiln.stages.precision.config import FallbackConfig
from kiln.stages.precision.variants import Source, build_fp8


def test_fp8_graph_of_an_mlp(tmp_path: Path) -> None:
    """Both linear layers quantized to E4M3 at opset 19; ONNX Runtime's CPU runs the graph (in float) for the gates,
    which it passes; the audit counts every FLOP of it in FP8."""
    model, x = _trained_mlp()
    proto = export_onnx(model, torch.from_numpy(x[:2]), tmp_path / "raw.onnx")
    src = Source.prepare(proto, tmp_path / "fp32.onnx", [x[:48], x[48:]], None)
    out = tmp_path / "fp8" / "model.onnx"
    entry = build_fp8(src, out, CalibrationConfig(cache=False), FallbackConfig(), x)
    graph = onnx.load(str(out))
    assert any(o.domain in ("", "ai.onnx") and o.version >= 19 for o in graph.opset_import)
    float8 = {t.name for t in graph.graph.initializer if t.data_type == onnx.TensorProto.FLOAT8E4M3FN}
    assert len(float8) >= 2  # the two weights, stored in E4M3
    assert entry["fallback"]["passed"] and entry["vs_fp32"]["cosine"] > 0.99
    assert entry["calibration"]["method"] == "minmax" and entry["calibration"]["qdq_nodes"]["QuantizeLinear"]
    assert audit_graph(out).share() == {"fp8": 1.0}


def _trained_mlp() -> tuple[torch.nn.Module, np.ndarray]:
    """An MLP trained for a few steps on 16 separable classes (prototypes plus noise): confident top-1 answers, as a
    trained model's are (an untrained one's near-ties flip under any quantization), and 96 held-out samples."""
    gen = torch.Generator().manual_seed(0)
    protos = 3 * torch.randn(16, 64, generator=gen)
    y = torch.randint(0, 16, (512,), generator=gen)
    x = protos[y] + 0.5 * torch.randn(512, 64, generator=gen)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 16))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(60):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[:416]), y[:416]).backward()
        opt.step()
    return model.eval(), x[416:].numpy()


def test_onnx_runtime_builds_no_fp8_engine() -> None:
    plan = _plan(OnnxRuntimeConfig(devices=["cpu", "cuda"]), "fp8")
    assert plan.devices == [] and len(plan.skipped) == 2 and "no FP8 kernels" in plan.skipped[0]
    assert _plan(OnnxRuntimeConfig(devices=["cpu"]), "int8").devices == ["cpu"]


def test_fp8_graph_of_a_cnn_is_judged_at_orts_basic_level(tmp_path: Path) -> None:
    """ONNX Runtime's extended CPU optimizations miscompute FP8 Q/DQ convolutions (cosine ~0.5 on this CNN): the
    check runs FP8 graphs at the basic level, where the graph's own FP8 error shows (cosine > 0.99)."""
    from kiln.core.onnx_io import ort_session

    torch.manual_seed(0)
    cnn = torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(32 * 8 * 8, 10),
    ).eval()
    x = np.random.default_rng(0).random((64, 1, 8, 8)).astype(np.float32)
    proto = export_onnx(cnn, torch.from_numpy(x[:2]), tmp_path / "raw.onnx")
    src = Source.prepare(proto, tmp_path / "fp32.onnx", [x[:32], x[32:]], None)
    out = tmp_path / "fp8" / "model.onnx"
    entry = build_fp8(src, out, CalibrationConfig(cache=False), FallbackConfig(enabled=False), x)
    assert entry["kept_fp32"] == [] and entry["vs_fp32"]["cosine"] > 0.99
    graph = onnx.load(str(out))
    want = ort_session(src.model).run(None, {"input": x})[0]
    got = ort_session(graph).run(None, {"input": x})[0]  # a float8 graph gets the basic level by itself
    assert float((got * want).sum() / np.linalg.norm(got) / np.linalg.norm(want)) > 0.99
