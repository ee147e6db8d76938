"""TensorRT builds with the TensorRT-RTX that is installed here: real parse + build + serialize, on CPU."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import onnx
import pytest

from kiln.core.errors import BuildError, ConfigError
from kiln.stages.engines.backend import read_metadata
from kiln.stages.engines.config import BuildConfig
from kiln.stages.engines.registry import load_engine, runnable
from kiln.stages.engines.stage import build_engine
from kiln.stages.engines.tensorrt.config import TensorRTConfig
from kiln.stages.engines.tensorrt.lib import features, import_tensorrt
from tests.stages.engines.build_graphs import written

pytestmark = pytest.mark.tensorrt
ZOO = ["cnn", "transformer", "mlp_embed"]
# Dtypes the precision leaves in TensorRT's parsed network (strongly typed: precision lives in the graph).
NETWORK_DTYPE = {"fp32": "FLOAT", "fp16": "HALF", "int8": "INT8"}


def trt_cfg(**kw) -> BuildConfig:
    return BuildConfig(backends=["tensorrt"], tensorrt=TensorRTConfig(**kw))


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8"])
@pytest.mark.parametrize("model", ZOO)
def test_zoo_builds_with_dynamic_batch(zoo, tmp_path: Path, model: str, precision: str) -> None:
    meta = build_engine(
        zoo(model, precision),
        tmp_path / "e",
        "tensorrt",
        "cuda",
        precision,
        trt_cfg(),
        tmp_path / "cache",
        max_batch=16,
    )
    assert written(meta) == read_metadata(tmp_path / "e")
    plan = tmp_path / "e" / "engine.plan"
    assert plan.stat().st_size > 10_000 and meta.size_bytes > plan.stat().st_size
    assert meta.flavour == import_tensorrt().__name__ and meta.backend_info["strongly_typed"]
    assert meta.precision == precision and meta.backend == "tensorrt"
    name = meta.inputs[0].name
    rest = meta.inputs[0].shape[1:]
    assert meta.backend_info["profiles"] == [{name: {"min": [1, *rest], "opt": [16, *rest], "max": [16, *rest]}}]
    layers = json.loads((tmp_path / "e" / meta.files["network_layers"]).read_text())
    dtypes = {o["dtype"] for layer in layers for o in layer["outputs"]}
    assert NETWORK_DTYPE[precision] in dtypes
    if precision == "fp32":
        assert "HALF" not in dtypes and "INT8" not in dtypes


def test_metadata_records_settings_and_not_runnable_reason(zoo, tmp_path: Path) -> None:
    cfg = trt_cfg(
        optimization_level=2,
        workspace_mb=256,
        avg_timing_iterations=2,
        max_aux_streams=0,
        tactic_sources=["JIT_CONVOLUTIONS", "EDGE_MASK_CONVOLUTIONS"],
    )
    meta = build_engine(zoo("cnn"), tmp_path / "e", "tensorrt", "cuda", "fp32", cfg, tmp_path / "cache")
    assert meta.builder_settings == {
        "optimization_level": 2,
        "workspace_mb": 256,
        "avg_timing_iterations": 2,
        "max_aux_streams": 0,
        "tactic_sources": ["JIT_CONVOLUTIONS", "EDGE_MASK_CONVOLUTIONS"],
    }
    assert meta.versions == {meta.flavour: import_tensorrt().__version__}
    assert meta.backend_info["features"] == features(import_tensorrt())
    assert len(meta.settings_hash) == 64 and meta.build_seconds > 0
    other = build_engine(zoo("cnn"), tmp_path / "e2", "tensorrt", "cuda", "fp32", trt_cfg(), tmp_path / "cache")
    assert other.settings_hash != meta.settings_hash
    ok, why = runnable(meta)
    if not ok:  # on this CPU machine, and on the H200 with TensorRT-RTX
        assert "GPU" in why or "compute capability" in why
        with pytest.raises(Exception, match="cannot run engine"):
            load_engine(tmp_path / "e")


def test_rtx_first_build_attaches_no_timing_cache_and_says_nothing_alarming(zoo, tmp_path: Path, caplog) -> None:
    if features(import_tensorrt())["timing_cache"]:
        pytest.skip("full TensorRT keeps a timing cache (next test)")
    caplog.set_level("DEBUG")
    meta = build_engine(zoo("cnn"), tmp_path / "a", "tensorrt", "cuda", "fp32", trt_cfg(), tmp_path / "cache")
    assert "not used by TensorRT-RTX" in meta.backend_info["timing_cache"]["note"]
    assert not list((tmp_path / "cache").rglob("timing-*"))
    assert "timing cache will not be used" not in caplog.text.lower()
    assert "failed to deserialize" not in caplog.text.lower()


def test_timing_cache_written_and_reused(zoo, tmp_path: Path) -> None:
    if not features(import_tensorrt())["timing_cache"]:
        pytest.skip("TensorRT-RTX has no timing cache (its calls are no-ops); previous test")
    cache = tmp_path / "cache"
    first = build_engine(zoo("cnn"), tmp_path / "a", "tensorrt", "cuda", "fp32", trt_cfg(), cache)
    path = Path(first.backend_info["timing_cache"]["path"])
    assert path.is_file() and path.parent == cache / "tensorrt"
    assert (
        first.backend_info["timing_cache"]["loaded_bytes"] == 0
        and first.backend_info["timing_cache"]["saved_bytes"] == path.stat().st_size
    )
    second = build_engine(zoo("transformer"), tmp_path / "b", "tensorrt", "cuda", "fp32", trt_cfg(), cache)
    assert second.backend_info["timing_cache"]["path"] == str(path)
    assert second.backend_info["timing_cache"]["loaded_bytes"] == first.backend_info["timing_cache"]["saved_bytes"] > 0


def test_parallel_builds_share_the_cache_safely(zoo, tmp_path: Path) -> None:
    cache, errors = tmp_path / "cache", []
    graphs = [zoo("cnn"), zoo("mlp_embed")]

    def build(i: int) -> None:
        try:
            build_engine(graphs[i], tmp_path / f"e{i}", "tensorrt", "cuda", "fp32", trt_cfg(), cache)
        except Exception as exc:  # collected: pytest does not see thread exceptions
            errors.append(exc)

    threads = [threading.Thread(target=build, args=(i,)) for i in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors
    files = list((cache / "tensorrt").glob("timing-*.cache"))
    if features(import_tensorrt())["timing_cache"]:  # TensorRT-RTX keeps none
        assert len(files) == 1 and files[0].stat().st_size > 0
    assert not list((cache / "tensorrt").glob(".*.tmp"))


def test_timing_cache_can_be_turned_off(zoo, tmp_path: Path) -> None:
    meta = build_engine(
        zoo("cnn"), tmp_path / "e", "tensorrt", "cuda", "fp32", trt_cfg(timing_cache=False), tmp_path / "cache"
    )
    assert meta.backend_info["timing_cache"] is None and not list((tmp_path / "cache").rglob("timing-*"))


def test_compute_capability_targets(zoo, tmp_path: Path) -> None:
    if not features(import_tensorrt())["compute_capability_targets"]:
        pytest.skip("this TensorRT builds for the local GPU only (no compute-capability targets)")
    meta = build_engine(
        zoo("cnn"),
        tmp_path / "e",
        "tensorrt",
        "cuda",
        "fp32",
        trt_cfg(compute_capabilities=["sm89", "SM120"]),
        tmp_path / "cache",
    )
    assert (
        meta.backend_info["target"]["compute_capabilities"] == ["SM89", "SM120"]
        and meta.backend_info["target"]["key"] == "SM89+SM120"
    )
    if features(import_tensorrt())["timing_cache"]:  # the cache file is per target (TensorRT-RTX keeps none)
        assert "sm89-sm120" in Path(meta.backend_info["timing_cache"]["path"]).name
    with pytest.raises(ConfigError, match="unknown ComputeCapability 'SM90'") as err:
        build_engine(
            zoo("cnn"),
            tmp_path / "f",
            "tensorrt",
            "cuda",
            "fp32",
            trt_cfg(compute_capabilities=["SM90"]),
            tmp_path / "cache",
        )
    assert "SM89" in err.value.hint
    assert not (tmp_path / "f").exists()  # a failed build leaves nothing behind


@pytest.mark.parametrize(
    "profile, match",
    [
        (
            {"nope": {"min": [1, 1, 8, 8], "opt": [4, 1, 8, 8], "max": [8, 1, 8, 8]}},
            r"unknown \['nope'\].*missing \['input'\]",
        ),
        ({"input": {"min": [1, 8, 8], "opt": [4, 8, 8], "max": [8, 8, 8]}}, "rank 3 but the model's input has shape"),
        (
            {"input": {"min": [1, 3, 8, 8], "opt": [4, 3, 8, 8], "max": [8, 3, 8, 8]}},
            "axis 1 is fixed to 1 in the model",
        ),
    ],
)
def test_bad_profiles_are_config_errors(zoo, tmp_path: Path, profile: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        build_engine(
            zoo("cnn"), tmp_path / "e", "tensorrt", "cuda", "fp32", trt_cfg(profiles=[profile]), tmp_path / "cache"
        )


def test_unordered_profile_rejected_by_config() -> None:
    from kiln.pipeline.config import config_from_dict

    with pytest.raises(ConfigError, match="min <= opt <= max"):
        config_from_dict(
            {
                "build": {
                    "tensorrt": {
                        "profiles": [{"input": {"min": [8, 1, 8, 8], "opt": [4, 1, 8, 8], "max": [8, 1, 8, 8]}}]
                    }
                }
            }
        )


def test_several_profiles(zoo, tmp_path: Path) -> None:
    small = {"input": {"min": [1, 1, 8, 8], "opt": [1, 1, 8, 8], "max": [4, 1, 8, 8]}}
    large = {"input": {"min": [8, 1, 8, 8], "opt": [32, 1, 8, 8], "max": [64, 1, 8, 8]}}
    meta = build_engine(
        zoo("cnn"), tmp_path / "e", "tensorrt", "cuda", "fp32", trt_cfg(profiles=[small, large]), tmp_path / "cache"
    )
    assert meta.backend_info["profiles"] == [small, large]


def _custom_op_graph(path: Path) -> Path:
    from onnx import TensorProto, helper

    node = helper.make_node("Frobnicate", ["x"], ["y"], name="my_frob", domain="com.example")
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
    )
    onnx.save(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.example", 1)]),
        str(path),
    )
    return path


def test_unsupported_op_names_node_and_op(tmp_path: Path) -> None:
    with pytest.raises(BuildError, match=r"node 'my_frob' \(op Frobnicate\)") as err:
        build_engine(
            _custom_op_graph(tmp_path / "bad.onnx"),
            tmp_path / "e",
            "tensorrt",
            "cuda",
            "fp32",
            trt_cfg(),
            tmp_path / "cache",
        )
    assert "onnxruntime backend" in err.value.hint


def test_unfolded_export_gets_fold_constants_hint(zoo, tmp_path: Path) -> None:
    raw = zoo("cnn").parent / "cnn-export.onnx"  # straight from torch.onnx.export: ReduceMean axes not constant
    with pytest.raises(BuildError, match=r"\(op ReduceMean\)") as err:
        build_engine(raw, tmp_path / "e", "tensorrt", "cuda", "fp32", trt_cfg(), tmp_path / "cache")
    assert "fold_constants" in err.value.hint


def test_fp32_graph_for_fp16_engine_is_refused_when_strongly_typed(zoo, tmp_path: Path) -> None:
    if features(import_tensorrt())["fp16_flag"]:
        pytest.skip("this TensorRT still has the FP16 flag (weakly typed path)")
    with pytest.raises(BuildError, match="strongly typed") as err:
        build_engine(zoo("cnn"), tmp_path / "e", "tensorrt", "cuda", "fp16", trt_cfg(), tmp_path / "cache")
    assert "precision stage" in err.value.hint


def test_tensorrt_needs_cuda_device(zoo, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot build for device 'cpu'"):
        build_engine(zoo("cnn"), tmp_path / "e", "tensorrt", "cpu", "fp32", trt_cfg(), tmp_path / "cache")


def test_unknown_tactic_source(zoo, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown TacticSource 'MAGIC'"):
        build_engine(
            zoo("cnn"),
            tmp_path / "e",
            "tensorrt",
            "cuda",
            "fp32",
            trt_cfg(tactic_sources=["magic"]),
            tmp_path / "cache",
        )


def test_int32_bias_dequantize_gets_quantize_bias_hint(zoo, tmp_path: Path) -> None:
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static

    from tests.stages.engines.build_graphs import sample

    class Reader:
        def __init__(self) -> None:
            self.batches = iter([{"input": sample("cnn", 4)}])

        def get_next(self):
            return next(self.batches, None)

    bad = tmp_path / "int32-bias.onnx"  # ORT's default quantizes biases to int32, which TensorRT rejects
    quantize_static(
        str(zoo("cnn")),
        str(bad),
        Reader(),
        quant_format=QuantFormat.QDQ,
        activation_type=QuantType.QInt8,
        weight_type=QuantType.QInt8,
        extra_options={"ActivationSymmetric": True, "WeightSymmetric": True},
    )
    with pytest.raises(BuildError, match=r"\(op DequantizeLinear\)") as err:
        build_engine(bad, tmp_path / "e", "tensorrt", "cuda", "int8", trt_cfg(), tmp_path / "cache")
    assert "QuantizeBias=False" in err.value.hint


def test_graph_carries_precision(zoo) -> None:
    from kiln.core.onnx_io import graph_carries_precision

    assert [graph_carries_precision(zoo("cnn", p)) for p in ("fp32", "fp16", "int8")] == [False, True, True]


@pytest.mark.trt_runtime
@pytest.mark.parametrize("cuda_graph", [True, False])
def test_tensorrt_runner_matches_onnxruntime(zoo, tmp_path: Path, cuda_graph: bool) -> None:
    import numpy as np
    import onnxruntime as ort

    from tests.stages.engines.build_graphs import sample

    meta = build_engine(
        zoo("transformer"),
        tmp_path / "e",
        "tensorrt",
        "cuda",
        "fp32",
        trt_cfg(cuda_graph=cuda_graph),
        tmp_path / "cache",
    )
    ok, why = runnable(meta)
    if not ok:
        pytest.skip(f"no TensorRT runtime that can execute here: {why}")
    sess = ort.InferenceSession(str(zoo("transformer")), providers=["CPUExecutionProvider"])
    with load_engine(tmp_path / "e") as runner:
        for batch in (1, 7, 1):
            x = sample("transformer", batch, seed=batch)
            np.testing.assert_allclose(
                runner.infer({"input": x})["logits"], sess.run(None, {"input": x})[0], atol=2e-3, rtol=2e-3
            )
        times = runner.time_ms({"input": sample("transformer", 4)}, warmup=2, iterations=5)
    assert len(times) == 5 and all(t > 0 for t in times)
