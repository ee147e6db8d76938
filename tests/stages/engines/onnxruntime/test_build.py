"""ONNX Runtime engines: built for real and run with ONNX Runtime (CPU here; CUDA tests need onnxruntime-gpu)."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from kiln.core.onnx_io import ort_session
from kiln.core.records import TensorSpec
from kiln.models.registry import build_model
from kiln.stages.engines.backend import read_metadata
from kiln.stages.engines.config import BuildConfig
from kiln.stages.engines.onnxruntime.config import OnnxRuntimeConfig
from kiln.stages.engines.registry import load_engine, runnable
from kiln.stages.engines.stage import MislabelledEngine, build_engine
from kiln.stages.export.torch_export import export_onnx
from tests.stages.engines.build_graphs import sample, written

ZOO = ["cnn", "transformer", "mlp_embed"]
HAS_CUDA_EP = "CUDAExecutionProvider" in ort.get_available_providers()


def ort_cfg(**kw) -> BuildConfig:
    return BuildConfig(backends=["onnxruntime"], onnxruntime=OnnxRuntimeConfig(**kw))


def reference(path: Path, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: x})[0]


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_a_mislabelled_engine_is_refused_before_any_session_opens_it(
    zoo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The audit reads the engine graph as soon as it is written: an "FP16" CPU engine that computes in FP32 is
    refused without the load check or autotuning (time spent on an engine that is not kept; and ONNX Runtime
    crashes the process opening some such graphs at load level all, an FP16 LSTM's)."""
    import kiln.stages.engines.onnxruntime.build as ort_build

    opened: list[Path] = []
    real = ort_build.settle_load
    monkeypatch.setattr(ort_build, "settle_load", lambda path, *a, **k: opened.append(path) or real(path, *a, **k))
    with pytest.raises(MislabelledEngine, match="computes 0% in fp16"):
        build_engine(zoo("cnn", "fp16"), tmp_path / "e", "onnxruntime", "cpu", "fp16", ort_cfg(), tmp_path / "c")
    assert opened == [] and not (tmp_path / "e").exists()


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8"])
@pytest.mark.parametrize("model", ZOO)
def test_cpu_engine_builds_and_runs(zoo, tmp_path: Path, model: str, precision: str) -> None:
    if precision == "fp16":  # ORT's CPU provider computes FP16 MatMul/Conv in FP32: the audit refuses the label
        with pytest.raises(MislabelledEngine, match="computes 0% in fp16"):
            build_engine(zoo(model, precision), tmp_path / "e", "onnxruntime", "cpu", "fp16", ort_cfg(), tmp_path / "c")
        return
    graph = zoo(model, "int8_cpu" if precision == "int8" else precision)  # Q/DQ pairs ORT's CPU provider fuses
    meta = build_engine(graph, tmp_path / "e", "onnxruntime", "cpu", precision, ort_cfg(), tmp_path / "cache")
    assert (tmp_path / "e" / "engine.onnx").is_file() and written(meta) == read_metadata(tmp_path / "e")
    assert runnable(meta) == (True, "")
    x = sample(model, 5, seed=3)
    with load_engine(tmp_path / "e") as runner:
        got = runner.infer({"input": x})["logits"]
        times = runner.time_ms({"input": x}, warmup=1, iterations=3)
    ref32 = reference(zoo(model), x)
    assert got.shape == ref32.shape and len(times) == 3 and all(t > 0 for t in times)
    if precision == "fp32":
        np.testing.assert_allclose(got, ref32, atol=1e-4, rtol=1e-4)
    else:
        assert cosine(got, ref32) > 0.99


@pytest.mark.parametrize("model", ["cnn", "transformer"])
def test_an_int8_engine_built_where_int8_saturates_computes_the_same(
    zoo, tmp_path: Path, model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On an x86 CPU without VNNI Kiln's sessions set session.x64quantprecision, a graph pass that rewrites int8
    weights to uint8 (kiln.core.cpu_int8): such a CPU is simulated here. The engine built there holds the rewritten
    weights and computes what the engine built on a CPU with VNNI computes (both loaded on this machine's CPU, whose
    sessions are exact either way)."""
    x = sample(model, 5, seed=3)
    outs = {}
    for saturating in (False, True):
        out = tmp_path / f"e-{saturating}"
        with monkeypatch.context() as patch:
            patch.setattr("kiln.core.cpu_int8.this_cpu_saturates", lambda s=saturating: s)
            build_engine(zoo(model, "int8_cpu"), out, "onnxruntime", "cpu", "int8", ort_cfg(), tmp_path / "cache")
        weights = [i.name for i in onnx.load(str(out / "engine.onnx")).graph.initializer]
        assert any(w.endswith("_s8_2_u8") for w in weights) is saturating
        with load_engine(out) as runner:
            outs[saturating] = runner.infer({"input": x})["logits"]
    np.testing.assert_allclose(outs[True], outs[False], atol=1e-5)


def test_cpu_metadata_and_session_settings(zoo, tmp_path: Path) -> None:
    cfg = ort_cfg(intra_op_threads=1, inter_op_threads=2, execution_mode="parallel")
    meta = build_engine(zoo("cnn"), tmp_path / "e", "onnxruntime", "cpu", "fp32", cfg, tmp_path / "cache")
    assert meta.backend_info["session"] == {
        "providers": ["CPUExecutionProvider"],
        "intra_op_threads": 1,
        "inter_op_threads": 2,
        "execution_mode": "parallel",
        "offline_optimization": "extended",
        "load_optimization": "all",
    }
    assert meta.versions == {"onnxruntime": ort.__version__} and meta.backend_info["cuda_graph"] is False
    assert meta.inputs == [TensorSpec(name="input", shape=["batch", 1, 8, 8], dtype="float32")]
    assert meta.outputs == [TensorSpec(name="logits", shape=["batch", 10], dtype="float32")]
    assert meta.size_bytes >= (tmp_path / "e" / "engine.onnx").stat().st_size
    with load_engine(tmp_path / "e") as runner:
        opts = runner.session.get_session_options()
        assert opts.intra_op_num_threads == 1 and opts.execution_mode == ort.ExecutionMode.ORT_PARALLEL


SPIN = "session.intra_op.allow_spinning"


def test_a_served_engine_does_not_busy_wait_between_calls(zoo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Opened for a server, the session's thread pools block between calls (ORT's default spins, taking the cores
    a server's own threads need); opened otherwise, or with KILN_ORT_SPINNING=1, ORT's default stands."""
    build_engine(zoo("cnn"), tmp_path / "e", "onnxruntime", "cpu", "fp32", ort_cfg(), tmp_path / "cache")
    x = np.random.default_rng(0).standard_normal((2, 1, 8, 8), dtype=np.float32)
    with load_engine(tmp_path / "e", serving=True) as runner:
        opts = runner.session.get_session_options()
        assert opts.get_session_config_entry(SPIN) == "0"
        assert opts.get_session_config_entry("session.inter_op.allow_spinning") == "0"
        served = runner.infer({"input": x})["logits"]
    with load_engine(tmp_path / "e") as runner:
        with pytest.raises(RuntimeError):  # ORT: an entry never set
            runner.session.get_session_options().get_session_config_entry(SPIN)
        np.testing.assert_array_equal(served, runner.infer({"input": x})["logits"])
    monkeypatch.setenv("KILN_ORT_SPINNING", "1")
    with load_engine(tmp_path / "e", serving=True) as runner:
        with pytest.raises(RuntimeError):
            runner.session.get_session_options().get_session_config_entry(SPIN)


def test_offline_optimization_is_saved(zoo, tmp_path: Path) -> None:
    """ORT's extended fusions ran at build time (Transpose+MatMul became FusedMatMul), not at each load."""
    assert "FusedMatMul" not in {n.op_type for n in onnx.load(str(zoo("transformer"))).graph.node}
    build_engine(
        zoo("transformer"),
        tmp_path / "e",
        "onnxruntime",
        "cpu",
        "fp32",
        ort_cfg(transformer_fusion="off"),
        tmp_path / "cache",
    )
    ops = {n.op_type for n in onnx.load(str(tmp_path / "e" / "engine.onnx")).graph.node}
    assert "FusedMatMul" in ops


def test_transformer_fusion_applied_and_exact(zoo, tmp_path: Path) -> None:
    meta = build_engine(zoo("transformer"), tmp_path / "e", "onnxruntime", "cpu", "fp32", ort_cfg(), tmp_path / "cache")
    fusion = meta.builder_settings["transformer_fusion"]
    assert fusion["applied"] and fusion["fused"].get("SkipLayerNormalization", 0) >= 1
    ops = {n.op_type for n in onnx.load(str(tmp_path / "e" / "engine.onnx")).graph.node}
    assert "SkipLayerNormalization" in ops
    x = sample("transformer", 4)
    with load_engine(tmp_path / "e") as runner:
        np.testing.assert_allclose(runner.infer({"input": x})["logits"], reference(zoo("transformer"), x), atol=1e-4)


def test_fusion_leaves_the_callers_graph_unfused(zoo) -> None:
    """ORT's optimize_model rewrites its input in place; the parity check needs the unfused graph intact."""
    from kiln.stages.engines.onnxruntime.build import maybe_fuse

    model = onnx.load(str(zoo("transformer")))
    before = [n.op_type for n in model.graph.node]
    fused, note = maybe_fuse(model, "cpu", OnnxRuntimeConfig())
    assert note["applied"] and fused is not model
    assert [n.op_type for n in model.graph.node] == before
    assert "SkipLayerNormalization" in {n.op_type for n in fused.graph.node}


def test_the_optimizers_producer_warning_goes_to_the_debug_log(zoo, caplog) -> None:
    """ORT's optimizer warns "Model producer not matched" of a quantized graph (producer onnx.quantize); without
    logging set up (the Python API) that reached stderr."""
    from kiln.stages.engines.onnxruntime.build import maybe_fuse

    model = onnx.load(str(zoo("transformer")))
    model.producer_name = "onnx.quantize"
    caplog.set_level(logging.DEBUG)
    maybe_fuse(model, "cpu", OnnxRuntimeConfig())
    ort = [r for r in caplog.records if r.name.startswith("onnxruntime.transformers")]
    assert not ort, [r.getMessage() for r in ort]
    assert any("producer not matched" in r.getMessage() for r in caplog.records if r.name == "kiln.build")


def test_an_input_no_node_reads_survives_the_fusion(zoo) -> None:
    """ORT's optimizer prunes an input nothing reads (a tokenizer's token_type_ids beside a DistilBERT); the
    parity check then failed feeding it, and the fusion was dropped with a warning per build."""
    from onnx import TensorProto, helper

    from kiln.stages.engines.onnxruntime.build import maybe_fuse

    model = onnx.load(str(zoo("transformer")))
    model.graph.input.append(helper.make_tensor_value_info("token_type_ids", TensorProto.INT64, ["batch", 8]))
    fused, note = maybe_fuse(model, "cpu", OnnxRuntimeConfig())
    assert note["applied"], note
    assert [i.name for i in fused.graph.input] == [i.name for i in model.graph.input]


class AudioTransformer(torch.nn.Module):
    """The zoo transformer behind a convolution over audio (kernel ``k``) on a dynamic ``samples`` axis."""

    def __init__(self, k: int = 10) -> None:
        super().__init__()
        self.conv, self.body = torch.nn.Conv1d(1, 64, k, k), build_model("transformer", {})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.conv(x).mean(-1).reshape(-1, 1, 8, 8))


def test_a_fusion_check_on_unsized_axes_says_how_to_size_them(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``kiln build FILE`` without signature.shapes: the check tries a few sizes; a kernel-10 convolution runs at
    16 samples and is fused; one of 400 (wav2vec's receptive field) refuses them all, and the warning says how to
    give the sizes."""
    from kiln.stages.engines.onnxruntime.build import maybe_fuse

    torch.manual_seed(0)
    short = tmp_path / "short.onnx"
    export_onnx(AudioTransformer(10).eval(), torch.randn(2, 1, 100), short, dynamic_axes={"input": {2: "samples"}})
    assert maybe_fuse(onnx.load(str(short)), "cpu", OnnxRuntimeConfig())[1]["applied"]
    path = tmp_path / "audio.onnx"
    export_onnx(AudioTransformer(400).eval(), torch.randn(2, 1, 800), path, dynamic_axes={"input": {2: "samples"}})
    model = onnx.load(str(path))
    with caplog.at_level(logging.WARNING, logger="kiln"):
        _, note = maybe_fuse(model, "cpu", OnnxRuntimeConfig())
    assert not note["applied"] and "cannot run random inputs" in note["why"]
    warned = [r.getMessage() for r in caplog.records if "fusion not applied" in r.getMessage()]
    assert len(warned) == 1 and warned[0].endswith(
        "keeping the unfused graph (dynamic axis 'samples' ran at 2, 16, 64 and 256: give the sizes the model "
        "takes, --set 'signature.shapes={samples: [MIN, MAX]}')"
    )
    _, sized = maybe_fuse(model, "cpu", OnnxRuntimeConfig(), {"input": {2: 800}})  # what signature.shapes gives
    assert sized["applied"], sized


@pytest.mark.parametrize(
    "setting, model, why", [("off", "transformer", "off in config"), ("auto", "cnn", "no attention-like ops")]
)
def test_transformer_fusion_skipped(zoo, tmp_path: Path, setting: str, model: str, why: str) -> None:
    meta = build_engine(
        zoo(model),
        tmp_path / "e",
        "onnxruntime",
        "cpu",
        "fp32",
        ort_cfg(transformer_fusion=setting),
        tmp_path / "cache",
    )
    assert meta.builder_settings["transformer_fusion"] == {"applied": False, "why": why}


def test_fp16_engine_from_fp32_graph_fuses_then_converts(zoo, tmp_path: Path) -> None:
    """A CUDA engine (built here, run on a GPU): fused, then converted; its graph computes in FP16 and agrees with
    FP32 (run here through a plain CPU session of the engine's graph)."""
    meta = build_engine(zoo("transformer"), tmp_path / "e", "onnxruntime", "cuda", "fp16", ort_cfg(), tmp_path / "c")
    assert meta.builder_settings["transformer_fusion"]["applied"]
    assert "fp16_conversion" in meta.builder_settings and meta.audit["share"].get("fp16", 0) >= 0.5
    model = onnx.load(str(tmp_path / "e" / "engine.onnx"))
    assert any(i.data_type == onnx.TensorProto.FLOAT16 for i in model.graph.initializer)
    x = sample("transformer", 4)
    sess = ort_session(tmp_path / "e" / "engine.onnx")
    assert cosine(sess.run(None, {"input": x})[0], reference(zoo("transformer"), x)) > 0.999


def test_fp16_engine_keeps_the_precision_stages_fp32_nodes_through_fusion(zoo, tmp_path: Path) -> None:
    """The precision stage kept the LayerNorms FP32; ORT's fusion renames them (SkipLayerNormalization), which
    once dropped them silently from the keep list. Their fused heirs stay FP32 and the sidecar says so."""
    src = onnx.load(str(zoo("transformer")))
    lns = [n.name for n in src.graph.node if n.op_type == "LayerNormalization"]
    assert lns
    meta = build_engine(
        zoo("transformer"), tmp_path / "e", "onnxruntime", "cuda", "fp16", ort_cfg(), tmp_path / "cache", keep_fp32=lns
    )
    record = meta.builder_settings["fp16_kept_fp32"]
    assert record["requested"] == len(lns) and record["lost"] == [] and record["renamed"]
    assert meta.source.kept_fp32 == sorted(lns)
    plain = build_engine(
        zoo("transformer"), tmp_path / "p", "onnxruntime", "cuda", "fp16", ort_cfg(), tmp_path / "cache"
    )
    assert plain.settings_hash != meta.settings_hash  # the keep list is part of what was built
    model = onnx.load(str(tmp_path / "e" / "engine.onnx"))
    types = {i.name: i.data_type for i in model.graph.initializer}
    heirs = [n for n in model.graph.node if n.name in record["renamed"].values()]
    assert heirs and all(types.get(n.input[2]) == onnx.TensorProto.FLOAT for n in heirs)  # gamma stays FP32


def test_cuda_engine_builds_anywhere_and_says_why_it_cannot_run(zoo, tmp_path: Path) -> None:
    meta = build_engine(
        zoo("cnn", "fp16"), tmp_path / "e", "onnxruntime", "cuda", "fp16", ort_cfg(), tmp_path / "cache"
    )
    name, opts = meta.backend_info["session"]["providers"][0]
    assert name == "CUDAExecutionProvider" and opts["cudnn_conv_algo_search"] == "EXHAUSTIVE"
    assert opts["prefer_nhwc"] == "1" and meta.backend_info["cuda_graph"] is True  # Conv + fp16: NHWC on by default
    ok, why = runnable(meta)
    assert ok == HAS_CUDA_EP and (ok or "CUDAExecutionProvider" in why)


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graph", [True, False])
def test_cuda_runner_matches_cpu(zoo, tmp_path: Path, cuda_graph: bool) -> None:
    if not HAS_CUDA_EP:
        pytest.skip("onnxruntime-gpu's CUDAExecutionProvider is not installed")
    from kiln.stages.engines.onnxruntime.config import OrtAutotuneConfig, OrtCudaConfig

    # Autotuning off: it may choose cuda_graph off for a batch; this test checks the configured path itself.
    cfg = ort_cfg(devices=["cuda"], cuda=OrtCudaConfig(cuda_graph=cuda_graph), autotune=OrtAutotuneConfig(cuda=False))
    build_engine(zoo("transformer"), tmp_path / "e", "onnxruntime", "cuda", "fp32", cfg, tmp_path / "cache")
    with load_engine(tmp_path / "e") as runner:
        for batch in (1, 4, 1):  # shapes alternate: each has its own buffers / graph
            x = sample("transformer", batch, seed=batch)
            np.testing.assert_allclose(
                runner.infer({"input": x})["logits"], reference(zoo("transformer"), x), atol=1e-3
            )
        assert len(runner.slots) == 2 and all(s["static"] == cuda_graph for s in runner.slots.values())
        times = runner.time_ms({"input": sample("transformer", 4)}, warmup=2, iterations=5)
        assert len(times) == 5 and all(t > 0 for t in times)


def test_a_fused_op_without_a_cpu_kernel_keeps_the_unfused_graph() -> None:
    """ORT's transformer fusion can make ops with no CPU kernel (QOrderedGelu, on a quantized DeBERTa): the fusion
    check cannot run the fused graph, so it says why and the build keeps the unfused one, rather than failing."""
    from kiln.stages.engines.onnxruntime.build import _parity

    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 4])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)
    plain = onnx.helper.make_graph([onnx.helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    scale = onnx.numpy_helper.from_array(np.array(0.1, np.float32), "s")
    fused = onnx.helper.make_graph(
        [onnx.helper.make_node("QOrderedGelu", ["x", "s", "s"], ["y"], domain="com.microsoft")],
        "g",
        [x],
        [y],
        [scale],
    )
    opsets = [onnx.helper.make_opsetid("", 17), onnx.helper.make_opsetid("com.microsoft", 1)]
    ref, new = (onnx.helper.make_model(g, opset_imports=opsets) for g in (plain, fused))
    assert "cannot run on CPU to check" in _parity(ref, new)


def test_the_fusion_check_runs_at_a_size_the_model_takes() -> None:
    """A dynamic time axis under a kernel-10 convolution: at 2 samples ONNX Runtime raised out of the build (a
    traceback through `kiln run`, seen on a transformers Wav2Vec2); now the check says it could not run, and at the
    data's length it runs."""
    from kiln.stages.engines.onnxruntime.build import _parity

    w = onnx.numpy_helper.from_array(np.ones((2, 1, 10), np.float32), "w")
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Conv", ["x", "w"], ["y"])],
        "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 1, "time"])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
        [w],
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    assert _parity(model, model) is None  # unsized: 2 samples fail, 16 run
    assert "cannot run random inputs" in _parity(model, model, dynamic=4)  # a size given is the one tried
    video = onnx.helper.make_graph(  # [batch, 3, T, H, W]: 2 x 3 x 256^3 floats is past the tries' memory
        [onnx.helper.make_node("Conv", ["x", "w5"], ["y"])],
        "v",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 3, "t", "h", "w"])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
        [onnx.numpy_helper.from_array(np.ones((1, 3, 70, 70, 70), np.float32), "w5")],
    )
    video_model = onnx.helper.make_model(video, opset_imports=[onnx.helper.make_opsetid("", 17)])
    assert "cannot run random inputs" in _parity(video_model, video_model)  # 2, 16 and 64 fail; 256 is not tried
    assert _parity(model, model, dynamic=64) is None


def test_a_fused_op_with_no_cpu_kernel_is_named_whole_in_the_fusion_warning() -> None:
    """The reason was cut at 120 characters, inside the op's name ("implementation for QOrd")."""
    from onnx import TensorProto, helper, numpy_helper

    from kiln.stages.engines.onnxruntime.build import _parity

    def graph(node: onnx.NodeProto, dtype: int, inits: list[onnx.TensorProto]) -> onnx.ModelProto:
        x, y = (helper.make_tensor_value_info(n, dtype, ["batch", 4]) for n in ("x", "y"))
        opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
        return helper.make_model(helper.make_graph([node], "g", [x], [y], inits), opset_imports=opsets)

    ref = graph(helper.make_node("Relu", ["x"], ["y"]), TensorProto.FLOAT, [])
    scale = numpy_helper.from_array(np.array(1.0, np.float32), "s")
    fused = helper.make_node(
        "QOrderedGelu", ["x", "s", "s"], ["y"], domain="com.microsoft", name="gelu_" + "x" * 60, order_X=1, order_Y=1
    )
    why = _parity(ref, graph(fused, TensorProto.INT8, [scale])) or ""
    assert why.startswith("cannot run on CPU to check (") and why.endswith("implementation for QOrderedGelu(1))")
    assert "[ONNXRuntimeError]" not in why
