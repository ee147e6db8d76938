import json
import mmap
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kiln.core.compare import compare_arrays
from kiln.core.data import DatasetSplits
from kiln.core.records import Baseline, EngineMetadata, EngineValidation, Percentiles
from kiln.core.shapes import resize
from kiln.stages.accuracy.check import compare_all, gates_for, labels_at_points
from kiln.stages.validate.baselines import measure, speedups
from kiln.stages.validate.config import ValidateConfig
from kiln.stages.validate.memory import PeakMemory
from kiln.stages.validate.stage import (
    accuracy_absent,
    check_gates,
    choose,
    compare,
    engine_hints,
)
from tests.conftest import tiny_config_dict


def test_compare_identical_and_perturbed() -> None:
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((100, 10)).astype(np.float32)
    labels = ref.argmax(-1)
    same = compare(ref, ref.copy(), labels)
    assert same["max_abs_err"] == 0 and same["cosine"] == pytest.approx(1.0) and same["top1_agreement"] == 1.0
    flipped = ref.copy()
    flipped[:10] = -flipped[:10]  # changes the argmax of (almost surely) all 10 rows
    res = compare(ref, flipped, labels)
    assert res["top1_agreement"] == pytest.approx(0.9) and res["accuracy"] == pytest.approx(0.9)
    assert res["cosine"] < 0.9


def test_token_labels_follow_their_input_through_each_validated_length() -> None:
    """Tags [N, seq] shaped like input_ids are cut or repeated as the ids are, so
    top-1 agreement and accuracy count the labelled tokens at every validated length; row labels stay as they are."""
    ids = np.arange(12).reshape(2, 6)
    feed = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    axes = {"input_ids": {1: "seq"}, "attention_mask": {1: "seq"}}
    feeds = [({"seq": n}, resize(feed, axes, {"seq": n})) for n in (4, 8)]
    tags = ids % 3
    short, long = labels_at_points(tags, feed, feeds, axes)
    assert np.array_equal(short, tags[:, :4])
    assert np.array_equal(long, tags[:, np.arange(8) % 6])
    rows = np.array([0, 1])
    assert all(r is rows for r in labels_at_points(rows, feed, feeds, axes))
    pixels = np.zeros((2, 5, 5), dtype=np.int64)  # shaped like no input: only at the data's own shape
    assert labels_at_points(pixels, feed, feeds, axes) == [None, None]
    assert labels_at_points(pixels, feed, [({}, feed)], axes)[0] is pixels


def entry(**kw) -> EngineValidation:
    base = {
        "cosine": 1.0,
        "max_abs_err": 0.0,
        "top1_agreement": 1.0,
        "accuracy": 0.95,
        "latency_ms": {"8": {"p50": 1.0, "p90": 1.1, "p99": 1.2}},
    }
    return EngineValidation(
        name="e", backend="onnxruntime", precision="fp32", device="cpu", status="validated", **{**base, **kw}
    )


def test_gates_name_the_failing_values() -> None:
    gates = gates_for(ValidateConfig(), "fp32")
    assert check_gates(entry(), 0.95, gates, 8) == []
    fails = check_gates(entry(cosine=0.99, top1_agreement=0.5, accuracy=0.80), 0.95, gates, 8)
    assert any("cosine 0.990000 < min_cosine 0.9999" in f for f in fails)
    assert any("top1_agreement 0.5000" in f for f in fails) and any("accuracy drop 0.1500" in f for f in fails)


def test_a_regression_is_gated_on_its_relative_error_too() -> None:
    """Targets around 10 shifted by 0.5: cosine 0.99997 passes FP32's 0.9999, the relative error (0.05) does not,
    nor, at INT8, the systematic error of the shift (0.05: every sample off alike).
    Without class logits the limit is the error min_cosine allows at right angles, sqrt(2 (1 - c)); class logits are
    held to it in FP32 and FP16 engines (their scale is the softmax's confidence), and in INT8 ones top-1 agreement
    guards the task and no relative error is gated unless max_rel_err says so."""
    ref = 10 + np.random.default_rng(0).normal(0, 0.4, 256)
    stats = compare_arrays(ref, ref + 0.5)
    assert stats.cosine > 0.9999 and stats.rel_err > 0.04
    shifted = entry(top1_agreement=None, accuracy=None, cosine=stats.cosine, outputs={"y": stats.as_dict()})
    fp32, int8 = gates_for(ValidateConfig(), "fp32", True), gates_for(ValidateConfig(), "int8", True)
    assert fp32["max_rel_err"] == 0.014142 and check_gates(shifted, None, fp32, 8) == [
        f"relative error {stats.rel_err:.4g} > max_rel_err 0.01414"
    ]
    # INT8's min_cosine 0.99 allows a relative error of 0.14; a shift alike on every sample is no quantization noise
    (only,) = check_gates(shifted, None, int8, 8)
    assert only.startswith(f"systematic error {stats.systematic_err:.4g} > max_systematic_err 0.03"), only
    assert "values are at the reference's scale and off by +0.5 on average" in only, only
    classifier = gates_for(ValidateConfig(), "fp32", False)  # a binary [N, 1] logit: held at FP32
    assert classifier["max_rel_err"] is None and check_gates(shifted, None, classifier, 8) == [
        f"relative error {stats.rel_err:.4g} > max_rel_err 0.01414"
    ]
    shifted8 = entry(top1_agreement=None, accuracy=None, cosine=stats.cosine, outputs={"y": stats.as_dict()})
    shifted8.precision = "int8"  # ... not in an INT8 engine
    assert check_gates(shifted8, None, gates_for(ValidateConfig(), "int8", False), 8) == []
    assert check_gates(shifted, None, {**int8, "max_rel_err": 0.01}, 8)


def test_an_error_over_a_small_spread_says_what_it_is_over() -> None:
    """An embedding that barely varies between the held-out samples (0.8 % of its norm): FP16-sized noise is 5 % of
    that spread at a cosine of 0.9999999; the failure says the error is over the spread and gives the one over
    the norm, where before it read as a 4 % error."""
    rng = np.random.default_rng(0)
    ref = {"embedding": 1 + 0.008 * rng.standard_normal((64, 32))}
    got = {"embedding": ref["embedding"] * (1 + 5e-4 * rng.standard_normal((64, 32)))}
    stats = compare_all(ref, got, None)["embedding"]
    assert stats.cosine > 0.999999 and stats.rel_err > 0.0447 and stats.norm_rel_err < 1e-3
    shifted = entry(top1_agreement=None, accuracy=None, cosine=stats.cosine, outputs={"embedding": stats.as_dict()})
    (failure,) = check_gates(shifted, None, gates_for(ValidateConfig(), "fp16", True), 8)
    assert failure.startswith(f"relative error {stats.rel_err:.4g} > max_rel_err 0.04472 (the RMS error over how")
    assert f"over its norm the error is {stats.norm_rel_err:.2g}" in failure


def test_nan_output_fails_cosine_gate() -> None:
    gates = gates_for(ValidateConfig(), "fp32")
    assert check_gates(entry(cosine=float("nan")), 0.95, gates, 8)


def test_per_precision_overrides() -> None:
    cfg = ValidateConfig()
    assert gates_for(cfg, "fp32")["min_cosine"] == 0.9999 and gates_for(cfg, "int8")["min_cosine"] == 0.99
    assert check_gates(entry(cosine=0.995), 0.95, gates_for(cfg, "int8"), 8) == []


def test_latency_budget_gate() -> None:
    cfg = ValidateConfig(gates={"max_latency_p50_ms": 0.5})
    assert any("p50 latency" in f for f in check_gates(entry(), 0.95, gates_for(cfg, "fp32"), 8))


def torch_engine(builder_settings: dict) -> EngineMetadata:
    """A GPU torch engine built with these settings: the torch backend's hints read them."""
    return EngineMetadata(
        name="torch-cuda-fp16",
        backend="torch",
        device="cuda",
        precision="fp16",
        inputs=[],
        outputs=[],
        source={"file": "m.onnx", "sha256": "0"},
        files={"program": "program.pt2"},
        flavour="compiled",
        versions={},
        builder_settings=builder_settings,
    )


def test_an_approximated_gelu_is_named_when_an_accuracy_gate_fails() -> None:
    """A GPU torch engine with GELUs in cuBLASLt's (tanh) epilogue: named as what to try, not for a latency miss."""
    built = {"gemm_epilogues": "bias_any_gelu", "gemm_epilogue_layers": {"linear_bias": 4, "linear_bias_gelu": 2}}
    cfg = ValidateConfig(gates={"max_latency_p50_ms": 0.5})
    accuracy_miss = check_gates(entry(cosine=0.99), 0.95, gates_for(cfg, "fp16"), 8)
    latency_miss = check_gates(entry(), 0.95, gates_for(cfg, "fp16"), 8)
    assert latency_miss and all(f.startswith("p50 latency") for f in latency_miss)
    assert [h for h in engine_hints(torch_engine(built), accuracy_miss) if "2 GELU layer(s)" in h]
    assert engine_hints(torch_engine(built), latency_miss) == [] and engine_hints(torch_engine(built), []) == []
    assert engine_hints(torch_engine({}), accuracy_miss) == []  # built without the approximation: nothing to say


def test_folded_and_fused_convolutions_are_named_when_an_accuracy_gate_fails() -> None:
    built = {
        "conv_epilogues": True,
        "conv_epilogue_layers": {"batch_norms_folded": 20, "conv_bias_relu": 9, "conv_bias_add_relu": 8},
    }
    cfg = ValidateConfig()
    accuracy_miss = check_gates(entry(cosine=0.99), 0.95, gates_for(cfg, "fp16"), 8)
    (hint,) = engine_hints(torch_engine(built), accuracy_miss)
    assert "20 BatchNorm(s)" in hint and "17 convolution(s)" in hint and "conv_epilogues: off" in hint
    failed = {"conv_epilogues": False, "conv_epilogues_failed": "RuntimeError: x"}  # built without them after all
    assert engine_hints(torch_engine(failed), accuracy_miss) == []
    assert (
        engine_hints(
            torch_engine({**built, "conv_epilogue_layers": dict.fromkeys(built["conv_epilogue_layers"], 0)}),
            accuracy_miss,
        )
        == []
    )  # nothing was rewritten: nothing to say


# ---------------------------------------------------------------- baselines per device, memory, chosen engine


def lat(**p50: float) -> dict[str, Percentiles]:
    return {bs.lstrip("b"): Percentiles(p50=v, p90=v, p99=v) for bs, v in p50.items()}


def test_speedups_only_against_baselines_on_the_engine_device() -> None:
    cpu = Baseline(kind="eager", device="cpu", accuracy=None, samples=1, latency_ms=lat(b1=10.0))
    gpu = Baseline(kind="eager", device="cuda", accuracy=None, samples=1, latency_ms=lat(b1=2.0))
    comp = Baseline(kind="compile", device="cuda", accuracy=None, samples=1, latency_ms=lat(b1=1.0))
    assert speedups("cuda", lat(b1=0.5), [cpu, gpu, comp])[0] == {"eager-cuda": {"1": 4.0}, "compile-cuda": {"1": 2.0}}
    assert speedups("cpu", lat(b1=5.0), [cpu, gpu])[0] == {"eager-cpu": {"1": 2.0}}


def rounds_of(*medians: float) -> Percentiles:
    """A latency timed in rounds with these per-round medians (p50: their median)."""
    p50 = float(np.median(medians))
    return Percentiles(p50=p50, p90=p50, p99=p50, rounds=list(medians))


def test_a_lead_within_the_noise_keeps_the_preferred_engine() -> None:
    """ORT 10 % faster at p50, but round by round the ratio swings across 1: TensorRT (preferred) is kept, and the
    note says why; a lead that holds in every round takes the choice."""

    def e(name: str, backend: str, p: Percentiles) -> EngineValidation:
        return EngineValidation(
            name=name, backend=backend, precision="fp32", device="cuda", status="validated", passed=True,
            latency_ms={"8": p},
        )  # fmt: skip

    noisy = [
        e("trt", "tensorrt", rounds_of(1.0, 1.2, 0.8, 1.1, 0.9, 1.0)),
        e("ort", "onnxruntime", rounds_of(1.1, 0.8, 0.9, 0.85, 1.0, 0.9)),
    ]
    chosen, notes = choose(noisy, ["tensorrt", "onnxruntime"], margin=0.03)
    assert chosen == {"8": "trt"} and "within the timing's noise" in notes["8"]
    steady = [
        e("trt", "tensorrt", rounds_of(1.0, 1.2, 0.8, 1.1, 0.9, 1.0)),
        e("ort", "onnxruntime", rounds_of(0.5, 0.6, 0.4, 0.55, 0.45, 0.5)),
    ]
    chosen, notes = choose(steady, ["tensorrt", "onnxruntime"], margin=0.03)
    assert chosen == {"8": "ort"} and not notes


def test_a_chosen_engine_slower_than_pytorch_beyond_the_noise_is_said() -> None:
    from kiln.stages.validate.stage import behind_pytorch

    def e(name: str, ratio: float, ci: tuple[float, float]) -> EngineValidation:
        return EngineValidation(
            name=name, backend="onnxruntime", precision="fp32", device="cpu", status="validated", passed=True,
            speedups={"eager-cpu": {"32": ratio, "1": 3.0}}, speedup_ci={"eager-cpu": {"32": ci, "1": (2.5, 3.5)}},
        )  # fmt: skip

    [note] = behind_pytorch([e("ort", 0.63, (0.60, 0.67))], {"1": "ort", "32": "ort"}).values()
    assert "ort, runs at 0.63x PyTorch eager on the CPU (95 % interval 0.60-0.67x)" in note
    assert note.endswith("add torch to build.backends with build.torch.devices: [cpu]")  # none was built
    assert behind_pytorch([e("ort", 0.9, (0.8, 1.05))], {"32": "ort"}) == {}  # within the noise: not said
    # a run from model.onnx: its baseline is that file in ONNX Runtime, and no PyTorch model to compile
    [note] = behind_pytorch([e("ort", 0.63, (0.60, 0.67))], {"32": "ort"}, onnx_file=True).values()
    assert "0.63x the input ONNX file in ONNX Runtime on the CPU" in note and "the input ONNX file itself" in note
    assert "torch" not in note


def test_slower_than_fp32_only_beyond_the_noise() -> None:
    from kiln.stages.precision.speed import speed_vs_fp32

    def e(name: str, precision: str, p: Percentiles) -> EngineValidation:
        return EngineValidation(
            name=name, backend="onnxruntime", precision=precision, device="cpu", status="validated", passed=True,
            latency_ms={"8": p},
        )  # fmt: skip

    fp32 = e("fp32", "fp32", rounds_of(1.0, 1.0, 1.0, 1.0, 1.0, 1.0))
    noisy = e("int8", "int8", rounds_of(1.3, 0.8, 1.2, 0.9, 1.1, 1.05))  # p50 1.075: "slower" by p50 alone
    [row] = speed_vs_fp32([fp32, noisy])
    assert row["vs_fp32"]["8"] < 1.0 and not row["slower"] and row["within_noise"]
    slow = e("int8", "int8", rounds_of(1.3, 1.4, 1.2, 1.5, 1.3, 1.35))
    [row] = speed_vs_fp32([fp32, slow])
    assert row["slower"] and not row["within_noise"] and row["vs_fp32_ci"]["8"][1] < 1.0


def test_choice_per_batch_is_the_fastest_passing_engine_tensorrt_kept_within_noise() -> None:
    def e(name: str, backend: str, passed: bool = True, **p50: float) -> EngineValidation:
        return EngineValidation(
            name=name,
            backend=backend,
            precision="fp16",
            device="cuda",
            status="validated",
            passed=passed,
            latency_ms=lat(**p50),
        )

    engines = [
        e("ort", "onnxruntime", b1=0.99, b32=1.0),
        e("trt", "tensorrt", b1=1.0, b32=2.0),
        e("fast-but-failed", "onnxruntime", passed=False, b1=0.1, b32=0.1),
    ]
    assert choose(engines, ["tensorrt", "onnxruntime"], margin=0.03)[0] == {"1": "trt", "32": "ort"}
    assert choose(engines, ["tensorrt", "onnxruntime"], margin=0.0)[0] == {"1": "ort", "32": "ort"}


def test_peak_memory_sees_an_allocation_on_the_cpu() -> None:
    # Fresh pages from the kernel (an anonymous mmap), touched: a malloc'd block can reuse pages that earlier
    # tests freed but the allocator kept resident, and then RSS does not grow (a peak of 0.0 MB in the full suite).
    size = 64 * 2**20
    with PeakMemory("cpu") as mem:
        block = mmap.mmap(-1, size)
        for offset in range(0, size, mmap.PAGESIZE):
            block[offset] = 1
        time.sleep(0.05)  # the sampler's turn
        block.close()
    assert 50 < mem.peak_mb < 200, mem.peak_mb


def test_baseline_records_its_device_memory_and_size() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    x = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
    b = measure(model, "eager", "cpu", "fp32", {1: x[:1], 8: x}, warmup=1, iterations=3, samples=8)
    assert b.device == "cpu" and b.label == "eager-cpu" and set(b.latency_ms) == {"1", "8"} and b.error is None
    assert b.memory.size_bytes == (16 * 32 + 32 + 32 * 4 + 4) * 4 and b.memory.peak_mb is not None


@pytest.mark.gpu
def test_cuda_baseline_runs_on_the_gpu_eager_and_compiled() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    x = np.random.default_rng(0).standard_normal((32, 64)).astype(np.float32)
    for kind in ("eager", "compile"):
        b = measure(model, kind, "cuda", "fp32", {1: x[:1], 32: x}, warmup=3, iterations=10, samples=32)
        assert b.error is None and b.device == "cuda" and b.latency_ms["32"].p50 > 0, b
        # read from the GPU's own counter (device-wide: other processes' work on the GPU can hide a small model's
        # growth, which the record then says instead of a figure)
        assert "mem_get_info" in b.memory.method and (b.memory.peak_mb is not None or "no growth" in b.memory.method)


@pytest.mark.slow
def test_pipeline_times_engines_against_eager_and_compiled_pytorch(tmp_path: Path) -> None:
    from kiln.pipeline.api import run_pipeline
    from kiln.pipeline.config import config_from_dict

    cfg = config_from_dict(tiny_config_dict(**{"validate.baselines": ["eager", "compile"]}))
    result, _ = run_pipeline(cfg, tmp_path)
    assert result.ok
    v = json.loads((tmp_path / "validate" / "validation.json").read_text())
    assert [(b["kind"], b["device"]) for b in v["baselines"]] == [("eager", "cpu"), ("compile", "cpu")]
    assert all(b["error"] is None and b["memory"]["size_bytes"] > 0 for b in v["baselines"])
    for e in v["engines"]:
        assert (
            set(e["speedups"]) == {"eager-cpu", "compile-cpu"}
            and e["speedup_vs_baseline"] == e["speedups"]["eager-cpu"]
        )
        assert e["memory"]["size_bytes"] > 0 and e["memory"]["peak_mb"] is not None
    passing = [e for e in v["engines"] if e["passed"]]
    assert v["chosen"] and set(v["chosen"].values()) <= {e["name"] for e in passing}
    report = (tmp_path / "report.md").read_text()
    assert "Chosen engine per batch size" in report and "### Memory" in report and "compile-cpu" in report


@pytest.mark.gpu
@pytest.mark.timeout(1200)  # torch.compile max-autotune of 4 graphs per baseline precision
def test_cuda_engines_are_timed_against_pytorch_on_the_gpu(tmp_path: Path) -> None:
    """Issue 12: a CPU baseline against a GPU engine reported 168x. Every engine's speedup is against PyTorch on
    its own device; the CUDA baselines ran on the GPU (fast), the CPU ones on the CPU."""
    import onnxruntime as ort

    from kiln.pipeline.api import run_pipeline
    from kiln.pipeline.config import config_from_dict

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime-gpu's CUDAExecutionProvider is not installed (the run's CUDA engine is an ORT one)")
    cfg = config_from_dict(
        tiny_config_dict(
            **{
                "build.onnxruntime.devices": ["cpu", "cuda"],
                "validate.baselines": ["eager", "compile"],
                "validate.baseline_precisions": ["fp32", "fp16"],
            }
        )
    )
    result, _ = run_pipeline(cfg, tmp_path)
    assert result.ok
    v = json.loads((tmp_path / "validate" / "validation.json").read_text())
    labels = {f"{b['kind']}-{b['device']}" + ("" if b["precision"] == "fp32" else "-fp16"): b for b in v["baselines"]}
    assert set(labels) == {
        "eager-cpu",
        "compile-cpu",
        "eager-cuda",
        "compile-cuda",
        "eager-cuda-fp16",
        "compile-cuda-fp16",
    }, [(k, b["error"]) for k, b in labels.items()]
    assert all(b["error"] is None for b in labels.values()), [(k, b["error"]) for k, b in labels.items()]
    assert "mem_get_info" in labels["eager-cuda"]["memory"]["method"]
    cuda = next(e for e in v["engines"] if e["device"] == "cuda")
    assert set(cuda["speedups"]) == {"eager-cuda", "compile-cuda", "eager-cuda-fp16", "compile-cuda-fp16"}
    assert cuda["speedup_vs_baseline"] == cuda["speedups"]["eager-cuda"]
    assert cuda["memory"]["peak_mb"] is not None and "mem_get_info" in cuda["memory"]["method"]
    print(
        {k: {bs: p["p50"] for bs, p in b["latency_ms"].items()} for k, b in labels.items()},
        {e["name"]: e["speedups"] for e in v["engines"]},
        v["chosen"],
    )


def test_outputs_whose_rows_read_their_batch_mates_are_batch_coupled() -> None:
    """A model whose axis 0 is time, not the batch (each row reads the rows before it), or that normalizes over
    the batch: its rows change with their batch mates, which shapes do not show; served batched, one request's
    answer would depend on another's. Row-wise outputs, float noise included, are not."""
    from kiln.stages.accuracy.check import batch_coupled

    feed = {"x": np.random.default_rng(0).standard_normal((16, 3)).astype(np.float32)}

    def run(f: dict) -> dict:
        x = f["x"]
        noise = 1 + 1e-7 * len(x)  # what another batch size's kernels may change
        return {"causal": np.cumsum(x, 0), "centred": x - x.mean(0), "rows": x * 2 * noise}

    assert batch_coupled(run, feed, 8, 1) == ["causal", "centred"]
    assert batch_coupled(run, feed, 1, 1) == []  # one row per call: no batch mates to read


def test_batch_coupled_outputs_are_found_at_the_validated_sizes() -> None:
    """An output [rows, rows] (a contrastive model's logits) follows the batch; a row-wise one does not. Probed at
    the largest validated batch against the smallest, or with one batch size against the held-out rows' last, shorter
    batch; a reference that cannot run the probe is left to the comparisons."""
    from kiln.stages.accuracy.check import batch_coupled

    feed = {"x": np.random.default_rng(0).standard_normal((18, 3)).astype(np.float32)}

    def run(f: dict) -> dict:
        x = f["x"]
        return {"sim": x @ x.T, "rows": x * 2}

    assert batch_coupled(run, feed, 4, 1) == ["sim"]
    assert batch_coupled(run, feed, 4, 4) == ["sim"]  # 18 rows: the last batch has 2
    assert batch_coupled(run, {"x": feed["x"][:16]}, 4, 4) == []  # whole batches only: nothing to tell apart

    def fails_small(f: dict) -> dict:
        if len(f["x"]) < 4:
            raise RuntimeError("needs 4 rows")
        return run(f)

    assert batch_coupled(fails_small, feed, 4, 1) == []


@pytest.mark.parametrize(
    ("labels", "logits", "score", "said"),
    [
        (None, "logits", -1, "the data has no held-out labels"),
        ("float", "logits", -1, "the labels are no classes"),
        ("int", None, -1, "no output is held as class logits"),
        ("int", "logits", None, "the labels per position fit no validated size"),
    ],
)
def test_report_json_says_why_the_baseline_has_no_accuracy(labels, logits, score, said) -> None:
    """``accuracy: null`` in report.json comes with the reason a reader of the JSON cannot infer from it alone."""
    x = torch.randn(8, 3)
    y = {None: None, "float": torch.randn(8), "int": torch.randint(0, 2, (8,))}[labels]
    data = DatasetSplits(x, y, x, y, 2 if labels == "int" else 0)
    ref = SimpleNamespace(accuracy=None, logits=logits, score=score)
    assert accuracy_absent(ref, data).startswith(said)
    assert accuracy_absent(SimpleNamespace(accuracy=0.9, logits="logits", score=-1), data) is None


def test_float_rows_beside_num_classes_are_said_as_packed_targets() -> None:
    """A multi-task model's labels, a class and a value per row as floats beside num_classes: the note says what
    they are, not only that they are no classes."""
    x, y = torch.randn(8, 3), torch.rand(8, 2)
    note = accuracy_absent(SimpleNamespace(accuracy=None, logits="cls", score=-1), DatasetSplits(x, y, x, y, 5))
    assert note.startswith(
        "the labels are no classes (float targets float32[8, 2] beside num_classes 5, which hold no class index "
        "per row): "
    )
    assert "no metric scores them: set validate.metric" in note


@pytest.mark.parametrize(
    ("outputs", "said"),
    [
        ({"start_logits": (4, 9), "end_logits": (4, 9)}, "2 outputs (start_logits, end_logits), none named 'logits'"),
        ({"last_hidden_state": (4, 3)}, "the only output, 'last_hidden_state', is named as features"),
        ({"logits": (4, 5)}, "output 'logits' has 5 entries on its class axis, the data 2 classes"),
    ],
)
def test_the_report_says_why_no_output_is_held_as_class_logits(outputs, said) -> None:
    """A question-answering model's two outputs: the report named every possible reason (float targets, no labels)
    but the one that held; it names that one, and the setting that fixes it."""
    x, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
    ref = SimpleNamespace(accuracy=None, logits=None, score=-1, outputs=[{k: np.zeros(v) for k, v in outputs.items()}])
    note = accuracy_absent(ref, DatasetSplits(x, y, x, y, 2))
    assert note.startswith(said) and note.endswith("signature.logits_output names the class-logit output")


def _apart_graph(tmp_path: Path) -> Path:
    """An export folder whose ``model.onnx`` adds ids to a mask whose lengths its exporter named apart (tf2onnx's
    ``unk__1``, ``unk__3``): the graph takes them at one length only."""
    import onnx
    from onnx import TensorProto, helper

    ins = [
        helper.make_tensor_value_info(k, TensorProto.FLOAT, ["batch", n])
        for k, n in (("ids", "unk__1"), ("mask", "unk__3"))
    ]
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", "unk__1"])
    graph = helper.make_graph([helper.make_node("Add", ["ids", "mask"], ["out"])], "g", ins, [out])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    (tmp_path / "export").mkdir()
    onnx.save(model, tmp_path / "export" / "model.onnx")
    return tmp_path / "export"


def test_a_reference_that_refuses_the_validated_shapes_is_one_error_naming_them_and_the_axes_to_tie(
    tmp_path: Path,
) -> None:
    """Validation sets each named axis apart (one at its smallest beside the other at its largest); ONNX Runtime's
    refusal escaped as a traceback. It is one error naming the shapes fed, and its fix, given as the --set it
    names, validates."""
    import re

    from kiln.core.errors import ModelError
    from kiln.pipeline.config import config_from_dict, set_value
    from kiln.stages.validate.stage import onnx_reference
    from tests.conftest import stage_context

    export = _apart_graph(tmp_path)
    short, long = {k: torch.rand(4, 4) for k in ("ids", "mask")}, {k: torch.rand(4, 6) for k in ("ids", "mask")}
    data = DatasetSplits(short, None, long, None)

    def reference(extra: dict) -> object:
        cfg = config_from_dict({"model": {"onnx": str(export / "model.onnx")}, "data": {"name": "m:load"}, **extra})
        ctx = stage_context("validate", cfg, tmp_path, tmp_path, {"export": export}, load_dataset=lambda: data)
        return onnx_reference(ctx, data, ValidateConfig())

    fed = r"on the validation inputs \{'ids': 'float32\[4, 4\]', 'mask': 'float32\[4, 6\]'\}"
    with pytest.raises(ModelError, match=fed) as err:
        reference({})
    flag = re.search(r"--set '(signature\.dynamic_axes)=(.*?)'", err.value.hint or "")
    assert flag is not None and flag.group(2) == "{ids: {1: seq}, mask: {1: seq}}"
    axes = set_value(flag.group(1), flag.group(2))  # the CLI's own reading of the --set
    ref, _ = reference({"signature": {"dynamic_axes": axes}})
    assert ref.outputs[-1]["out"].shape == (4, 6)


def test_latency_is_recorded_with_the_sizes_of_the_dynamic_axes_it_was_timed_at() -> None:
    """validation.json's ``timing.timed_at``: the last validated point (the largest sizes, which the reference feeds
    latency), only for a model with dynamic axes besides the batch."""
    from kiln.stages.validate.stage import timed_at

    feeds = [({"samples": 8000}, {}), ({"samples": 24000}, {})]
    assert timed_at(SimpleNamespace(feeds=feeds)) == {"timed_at": {"samples": 24000}}
    assert timed_at(SimpleNamespace(feeds=[({}, {})])) == {}
