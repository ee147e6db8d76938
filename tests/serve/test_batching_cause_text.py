"""`kiln loadtest`'s failure for an engine whose answers move with their batch mates names the cause that fits the
engine: an FP32 engine has no dynamic quantization, so its model's rows read their batch mates; an INT8 or FP8
engine whose scales are found over each batch (ORT's dynamic INT8, torch's tensorwise lowbit_scaling) is blamed on
its scaling, with its backend's setting for static scales."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.core.records import EngineMetadata, EngineSource
from kiln.serve import loadtest
from kiln.serve.loadtest import (
    BAND_CAP,
    TOLERANCE,
    answer_band,
    answer_error,
    answer_masks,
    answer_scales,
    batch_deviation,
    batching_cause,
    batching_hint,
    expected_outputs,
    relative_error,
)
from kiln.serve.server import ServedEngine
from kiln.stages.engines.backend import read_metadata
from kiln.stages.engines.config import BuildConfig
from kiln.stages.engines.registry import load_engine
from kiln.stages.engines.stage import build_direct

FEATURES, CLASSES, SERVED_BATCH = 8, 16, 16


def coupled_graph(path: Path) -> None:
    """``logits = (input + mean of the batch's inputs) @ w``: every row reads the whole batch."""
    w = np.random.default_rng(0).standard_normal((FEATURES, CLASSES)).astype(np.float32)
    nodes = [
        helper.make_node("ReduceMean", ["input", "axis0"], ["mean"], keepdims=1),
        helper.make_node("Add", ["input", "mean"], ["mixed"]),
        helper.make_node("MatMul", ["mixed", "w"], ["logits"]),
    ]
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array([0], np.int64), "axis0")]
    g = helper.make_graph(
        nodes,
        "coupled",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", FEATURES])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", CLASSES])],
        inits,
    )
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]), path)


def twins() -> np.ndarray:
    """32 requests, every odd one a copy of the one before it moved by 1e-3: answers too close together for a band
    wider than the cap."""
    x = np.random.default_rng(1).standard_normal((32, FEATURES)).astype(np.float32)
    x[1::2] = x[::2] + np.float32(1e-3)
    return x


def test_an_fp32_engines_batch_moved_answers_are_blamed_on_its_batch_coupled_model(tmp_path: Path) -> None:
    """The cause read "a dynamically quantized INT8 engine computes its activation scales per batch" for an FP32
    engine, and the fix told to load-test the FP32 engine, the one under test."""
    src = tmp_path / "coupled.onnx"
    coupled_graph(src)
    engine_dir = tmp_path / "onnxruntime-cpu-fp32"
    build_direct(src, engine_dir, "onnxruntime", "cpu", None, BuildConfig())
    meta = read_metadata(engine_dir)
    assert meta.precision == "fp32"
    x = twins()
    pool = [{"input": x[k : k + 1]} for k in range(len(x))]
    with load_engine(engine_dir) as runner:
        expected = expected_outputs(runner, pool)
        deviation = batch_deviation(runner, pool, expected, SERVED_BATCH, TOLERANCE["fp32"])
        batched = [runner.infer({"input": x[i : i + 8]}) for i in range(0, len(x), 8)]
    band = answer_band(TOLERANCE["fp32"], deviation)
    assert band[1] == BAND_CAP, (deviation, band)  # what batching moves the answers by cannot be held
    served = [{"logits": batched[j // 8]["logits"][j % 8 : j % 8 + 1]} for j in range(len(x))]
    masks = answer_masks(expected, ["logits"])
    held = (masks["logits"], answer_scales(expected, masks)["logits"])
    wrong = [
        relative_error(e["logits"], s["logits"], *held)
        for e, s in zip(expected, served)
        if not answer_error(e["logits"], s["logits"], band, *held)[0]
    ]
    assert wrong  # a correct server of the engine is counted wrong: the failure must say why

    cause = batching_cause(deviation, band, max(wrong), meta)
    assert cause and "the model's rows read their batch mates" in cause, cause
    assert "quantized" not in cause and "INT8" not in cause, cause
    hint = batching_hint(tmp_path, ServedEngine("onnxruntime_cpu_fp32", engine_dir, meta), "http")
    assert "kiln serve --max-batch 0" in hint and "kiln run --from validate" in hint, hint
    assert "load-test the FP32 engine" not in hint and "ort_cpu_scheme" not in hint, hint
    int8 = batching_cause(deviation, band, max(wrong), meta.model_copy(update={"precision": "int8"}))
    assert int8 and "activation scales per batch" in int8 and "batch-coupled" not in int8, int8


def _torch_meta(precision: str, scaling: str) -> EngineMetadata:
    source = EngineSource(file="model.onnx", sha256="0" * 64)
    return EngineMetadata(
        name=f"torch-cuda-{precision}",
        backend="torch",
        device="cuda",
        precision=precision,
        inputs=[],
        outputs=[],
        source=source,
        files={"model": "model.pt2"},
        flavour="compiled",
        versions={},
        builder_settings={"lowbit_scaling": scaling},
    )


DEVIATION = {"rtol": {"logits": 0.05}, "atol": 0.0, "batches": [8, 16], "separation": None}


@pytest.mark.parametrize("precision", ["fp8", "int8"])
def test_a_torch_lowbit_engine_with_per_batch_scales_is_blamed_on_its_scaling(
    tmp_path: Path, precision: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An FP8 engine with tensorwise scaling (each layer input's largest magnitude over the whole batch, at each
    call) was blamed on its model; the fix named ONNX Runtime's setting for an INT8 engine."""
    monkeypatch.setattr(loadtest, "find_engines", lambda engines: [])  # no FP32 engine served beside it
    meta = _torch_meta(precision, "tensorwise")
    cause = batching_cause(DEVIATION, (1e-3, BAND_CAP), 0.06, meta)
    assert cause and "build.torch.lowbit_scaling tensorwise" in cause and "batch mates" not in cause, cause
    hint = batching_hint(tmp_path, ServedEngine(f"torch_cuda_{precision}", tmp_path, meta), "http")
    assert "build.torch.lowbit_scaling: static" in hint and "ort_cpu_scheme" not in hint, hint
    assert f"an {precision.upper()} engine with static scales" in hint, hint
    for scaling in ("static", "rowwise"):  # fixed at the build, or each row's own: batch mates move neither
        fixed = _torch_meta(precision, scaling)
        cause = batching_cause(DEVIATION, (1e-3, BAND_CAP), 0.06, fixed)
        assert cause and "the model's rows read their batch mates" in cause, cause
        hint = batching_hint(tmp_path, ServedEngine(f"torch_cuda_{precision}", tmp_path, fixed), "http")
        assert "kiln serve --max-batch 0" in hint and "lowbit_scaling" not in hint, hint
