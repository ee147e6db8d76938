"""FP8 and INT8 linear layers (torch engine): rowwise or tensorwise scales, torch._scaled_mm and torch._int_mm."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kiln.stages.engines.torch.lowbit import LowbitLinear, observe, supported, to_lowbit


@pytest.mark.parametrize(
    ("precision", "dtype", "min_cos"), [("fp8", torch.bfloat16, 0.998), ("int8", torch.float32, 0.999)]
)
def test_a_lowbit_linear_agrees_with_its_linear(precision: str, dtype: torch.dtype, min_cos: float) -> None:
    """PyTorch runs rowwise _scaled_mm and _int_mm on the CPU too: the layers' numerics are checked here."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 32)
    x = torch.randn(3, 7, 64)  # 21 rows: _int_mm takes more than 16
    got = LowbitLinear(linear, precision, dtype)(x.to(dtype)).float()
    want = linear(x)
    cos = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)
    assert got.shape == want.shape and cos > min_cos  # E4M3: 3 mantissa bits; INT8: 255 levels, per row
    assert got.dtype == torch.float32 and LowbitLinear(linear, precision, dtype)(x.to(dtype)).dtype == dtype


@pytest.mark.parametrize("precision", ["fp8", "int8"])
def test_tensorwise_scales_are_one_per_tensor(precision: str) -> None:
    torch.manual_seed(0)
    linear, x = nn.Linear(64, 32), torch.randn(40, 64)
    layer = LowbitLinear(linear, precision, torch.float32, scaling="tensorwise")
    assert layer.weight_scale.dim() == 0
    cos = torch.nn.functional.cosine_similarity(layer(x).flatten(), linear(x).flatten(), dim=0)
    assert cos > 0.998


def test_int8_weights_are_integers_within_range() -> None:
    layer = LowbitLinear(nn.Linear(32, 16), "int8", torch.float32)
    assert layer.weight.dtype == torch.int8 and int(layer.weight.abs().max()) == 127  # each row's largest is 127
    assert layer.weight_scale.shape == (1, 16)


def test_observe_sees_each_layers_rows_and_range() -> None:
    """Tokens per sample for a layer over a sequence, one row for a head over the pooled vector; the largest input
    magnitude over every call (the example, then calibration batches)."""

    class Tagger(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj, self.head = nn.Linear(16, 32), nn.Linear(32, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.proj(x).mean(1))

    model, x = Tagger(), torch.randn(2, 20, 16)
    seen = observe(model, [lambda: model(x), lambda: model(5 * x)], batch=2)
    assert {k: v[0] for k, v in seen.items()} == {"proj": 20, "head": 1}
    assert seen["proj"][1] == pytest.approx(float(5 * x.abs().max()))


@pytest.mark.parametrize("precision", ["fp8", "int8"])
def test_static_scales_come_from_the_inputs_range(precision: str) -> None:
    """Static scaling: the input's scale is its calibrated range over the format's largest value; an input beyond
    that range saturates instead of overflowing."""
    torch.manual_seed(0)
    linear, x = nn.Linear(64, 32), torch.randn(40, 64)
    amax = float(x.abs().max())
    layer = LowbitLinear(linear, precision, torch.float32, scaling="static", input_amax=amax)
    assert float(layer.input_scale) == pytest.approx(amax / (448.0 if precision == "fp8" else 127.0))
    cos = torch.nn.functional.cosine_similarity(layer(x).flatten(), linear(x).flatten(), dim=0)
    assert cos > 0.998
    assert torch.isfinite(layer(100 * x)).all()
    with pytest.raises(ValueError, match="calibration"):
        LowbitLinear(linear, precision, torch.float32, scaling="static")


def test_only_layers_the_kernels_take_are_swapped() -> None:
    """Widths not multiples of 16, a listed layer, too few rows for _int_mm: kept, each with its reason; the
    FLOP share of the swapped layers is what the audit counts."""
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10), nn.Linear(10, 16), nn.Linear(16, 16))
    seen = {"0": (20, 1.0), "2": (20, 1.0), "3": (20, 1.0), "4": (1, 1.0)}
    report = to_lowbit(model, "int8", torch.float32, seen, exclude=["3"])
    assert isinstance(model[0], LowbitLinear) and all(isinstance(model[i], nn.Linear) for i in (2, 3, 4))
    assert report["lowbit_layers"] == 1 and report["lowbit_kernel"] == "torch._int_mm"
    kept = report["lowbit_kept"]
    assert "multiples of 16" in kept["2"] and kept["3"] == "listed in build.torch.lowbit_exclude"
    assert "more than 16" in kept["4"]
    flops = {"0": 20 * 64 * 32, "2": 20 * 32 * 10, "3": 20 * 10 * 16, "4": 16 * 16}
    assert report["lowbit_linear_share"] == pytest.approx(flops["0"] / sum(flops.values()), abs=1e-4)
    fp8 = nn.Sequential(nn.Linear(16, 16))
    assert to_lowbit(fp8, "fp8", torch.float16, {"0": (1, 1.0)})["lowbit_layers"] == 1  # FP8 GEMMs take one row
    unseen = nn.Sequential(nn.Linear(16, 16))
    assert to_lowbit(unseen, "fp8", torch.float16, {})["lowbit_kept"] == {"0": "not run by the example input"}


@pytest.mark.parametrize("precision", ["fp8", "int8"])
def test_no_such_gpu_is_a_skip_line(precision: str) -> None:
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9):
        pytest.skip("this machine's GPU has FP8 and INT8 tensor cores")
    why = supported(precision)
    assert why and ("tensor-core GEMMs" in why or "sees none" in why)


def test_the_plan_skips_lowbit_engines_without_their_gpu() -> None:
    from kiln.stages.engines.torch import _plan
    from kiln.stages.engines.torch.config import TorchConfig

    for precision in ("fp8", "int8"):
        plan = _plan(TorchConfig(devices=["cpu"]), precision)
        assert not plan.devices and "CUDA GPUs" in plan.skipped[0]
        if why := supported(precision):
            plan = _plan(TorchConfig(devices=["cuda"]), precision)
            assert not plan.devices and why in plan.skipped[-1]


class Tokens(nn.Module):
    """A small encoder-shaped model: 32 tokens of 64 features through an MLP block with a residual and a norm, pooled
    into 16 classes; every token layer has 32 rows per sample, which both kernels take."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down, self.norm, self.head = (
            nn.Linear(64, 256),
            nn.Linear(256, 64),
            nn.LayerNorm(64),
            nn.Linear(64, 16),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x + self.down(torch.nn.functional.gelu(self.up(x))))
        return self.head(x.mean(1))


def test_fit_keeps_the_layer_whose_own_error_misses_the_target() -> None:
    """One layer's input has an outlier, so its one scale per tensor rounds the other values coarsely: the scaling
    misses the target, and the fallback keeps that layer (the largest own error) in float, which meets it."""
    from functools import partial

    from kiln.stages.engines.torch.lowbit import fit, own_errors

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16)).eval()
    x = torch.randn(4, 20, 64)
    x[0, 0, 0] = 60.0  # one outlier in the first layer's input

    def outputs(module: nn.Module) -> list[torch.Tensor]:
        return [module(x)]

    seen = observe(model, [lambda: model(x)], batch=4)
    swap = partial(to_lowbit, precision="int8", out_dtype=torch.float32, seen=seen)
    scaling, kept, record = fit(model, outputs, swap, ["tensorwise"], {}, min_cosine=0.999)
    assert scaling == "tensorwise" and record["tensorwise_cosine"] < 0.999
    assert list(kept) == ["0"] and kept["0"].startswith("fallback round 1: its own output error")
    assert record["fallback"][-1]["cosine"] >= 0.999 and isinstance(model[0], nn.Linear)  # the model is untouched
    import copy

    trial = copy.deepcopy(model)
    swap(trial, scaling="tensorwise")
    errors = own_errors(trial, model, lambda: trial(x))
    assert max(errors, key=errors.__getitem__) == "0"


@pytest.mark.parametrize("precision", ["fp8", "int8"])
def test_the_builds_choice_on_calibration_batches(tmp_path, precision: str) -> None:
    """The torch build's low-precision step on the CPU (where PyTorch runs both kernels, slowly): the calibration
    batches saved by the precision stage are read, static scales are tried first and kept where the outputs hold,
    and the builder settings say what was measured; a CPU build itself is refused with the reason."""
    import numpy as np

    from kiln.calibration.feeds import save_feeds
    from kiln.core.errors import BuildError
    from kiln.core.records import TensorSpec
    from kiln.stages.engines.backend import BuildRequest
    from kiln.stages.engines.torch.build import _lowbit, _lowbit_device
    from kiln.stages.engines.torch.config import TorchConfig

    torch.manual_seed(0)
    model = Tokens().eval().to(torch.float16)  # the engine's dtype around its low-precision GEMMs
    feeds = tmp_path / "calibration.npz"
    batches = [np.random.default_rng(i).standard_normal((4, 32, 64)).astype(np.float32) for i in range(3)]
    save_feeds(batches, ["x"], feeds)
    req = BuildRequest(
        tmp_path / "m.onnx",
        tmp_path / "e",
        "cpu",
        precision,
        TorchConfig(devices=["cpu"]),
        tmp_path,
        [TensorSpec(name="x", shape=["batch", 32, 64], dtype="float32")],
        calibration=feeds,
    )
    with pytest.raises(BuildError, match="built for GPUs"):
        _lowbit_device(req)
    settings = _lowbit(model, req, (torch.randn(2, 32, 64),))
    assert settings["lowbit_calibration_batches"] == 3 and settings["lowbit_scaling"] == "static"
    assert (
        settings["lowbit_scaling_check"]["static_cosine"] >= 0.995
        and "fallback" not in settings["lowbit_scaling_check"]
    )
    assert isinstance(model.up, LowbitLinear) and model.up.static


class Attention(nn.Module):
    """Q, K and V read the same input (one group); the output projection reads another."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(64, 64) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        return self.o(torch.softmax(q @ k.transpose(-1, -2) / 8, -1) @ v)


class Twice(nn.Module):
    """One attention layer run twice (weights shared across depth, as ALBERT's): a new input each time."""

    def __init__(self) -> None:
        super().__init__()
        self.att = Attention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.att(self.att(x))


@pytest.mark.parametrize(("precision", "scaling"), [("int8", "rowwise"), ("int8", "tensorwise"), ("fp8", "static")])
def test_layers_that_read_one_input_become_one_gemm(precision: str, scaling: str) -> None:
    """Q, K and V: found by their shared input (also where the layer runs twice), swapped as one GEMM whose output
    each layer takes its columns of; the outputs agree with the layers swapped one by one (the same numbers where
    scales are per row) and nothing is held after the call."""
    import copy

    from kiln.stages.engines.torch.lowbit import LowbitSlice, MergedLowbit, own_errors, parallel_groups

    torch.manual_seed(0)
    x = torch.randn(2, 24, 64)
    for model, prefix in ((Attention().eval(), ""), (Twice().eval(), "att.")):
        groups = parallel_groups(model, lambda m=model: m(x))
        assert groups == [[f"{prefix}q", f"{prefix}k", f"{prefix}v"]]
        seen = observe(model, [lambda m=model: m(x)], batch=2)
        alone, merged = copy.deepcopy(model), copy.deepcopy(model)
        to_lowbit(alone, precision, torch.float32, seen, scaling=scaling)
        report = to_lowbit(merged, precision, torch.float32, seen, scaling=scaling, groups=groups)
        assert report["lowbit_merged"] == {"layers": 3, "gemms": 1} and report["lowbit_layers"] == 4
        q = merged.get_submodule(f"{prefix}q")
        assert isinstance(q, LowbitSlice) and isinstance(q.merged, MergedLowbit)
        with torch.inference_mode():
            got, want, ref = merged(x), alone(x), model(x)
        assert q.merged._input is None and q.merged._output is None
        cos = torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0)
        assert cos > 0.995
        if scaling == "rowwise":
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        errors = own_errors(merged, model, lambda m=merged: m(x))  # what the fallback ranks: each layer's own
        assert sorted(errors) == sorted(f"{prefix}{n}" for n in "qkvo") and max(errors.values()) < 0.1


def test_a_kept_layer_leaves_its_group_and_the_program_has_one_gemm_per_group() -> None:
    """A layer kept in float (listed, or by the fallback) is left out of the merged GEMM; torch.export traces the
    merged layers into one low-precision GEMM each."""
    from kiln.stages.engines.torch.lowbit import LowbitSlice, parallel_groups

    torch.manual_seed(0)
    model, x = Attention().eval(), torch.randn(2, 24, 64)
    groups = parallel_groups(model, lambda: model(x))
    seen = observe(model, [lambda: model(x)], batch=2)
    report = to_lowbit(model, "int8", torch.float32, seen, exclude=["k"], groups=groups)
    assert report["lowbit_merged"] == {"layers": 2, "gemms": 1} and isinstance(model.k, nn.Linear)
    assert isinstance(model.q, LowbitSlice) and isinstance(model.v, LowbitSlice) and model.v.start == 64
    program = torch.export.export(model, (x,))
    mms = [n for n in program.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten._int_mm.default]
    assert len(mms) == 2  # q+v merged, and o


class Encoder(nn.Module):
    """An attention block (Q, K and V read one input) before :class:`Tokens`' MLP block and head."""

    def __init__(self) -> None:
        super().__init__()
        self.att, self.tokens = Attention(), Tokens()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tokens(x + self.att(x))


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("precision, algorithms", [("fp8", "heuristic"), ("int8", "heuristic"), ("fp8", "measured")])
def test_lowbit_engine_of_a_small_encoder(tmp_path, precision: str, algorithms: str) -> None:
    """The torch backend's FP8/INT8 engine on a GPU that has the kernels: its token layers are low-precision GEMMs
    (the audit says which share of the FLOPs), Q, K and V one of them, with static FP8 scales the FFN's GELU and the
    next layer's cast in cuBLASLt's epilogue (with ``gemm_algorithms: measured`` the other FP8 layers through
    Kiln's cuBLASLt binding too), it is compiled and replayed as CUDA graphs, and it agrees with the FP32 graph at
    batch 1 and 32."""
    import numpy as np
    import onnx
    import onnxruntime as ort

    from kiln.calibration.feeds import save_feeds
    from kiln.stages.engines.config import BuildConfig
    from kiln.stages.engines.registry import load_engine
    from kiln.stages.engines.stage import build_engine
    from kiln.stages.engines.torch.config import TorchConfig
    from kiln.stages.export.torch_export import export_onnx

    if why := supported(precision):
        pytest.skip(why)

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return Encoder().eval()

    src = tmp_path / "tokens.onnx"
    export_onnx(model(), torch.randn(2, 32, 64), src)
    feeds = tmp_path / "calibration.npz"
    batches = [np.random.default_rng(i).standard_normal((8, 32, 64)).astype(np.float32) for i in range(4)]
    assert save_feeds(batches, [onnx.load(str(src)).graph.input[0].name], feeds) == 4
    cfg = BuildConfig(backends=["torch"], torch=TorchConfig(devices=["cuda"], gemm_algorithms=algorithms))
    meta = build_engine(
        src, tmp_path / "e", "torch", "cuda", precision, cfg, tmp_path / "c", torch_model=model, calibration=feeds
    )
    settings = meta.builder_settings
    kept = {"fp8": [], "int8": ["tokens.head"]}[precision]  # 1 row per sample: _int_mm takes > 16
    assert settings["lowbit_layers"] == 7 - len(kept) and list(settings["lowbit_kept"]) == kept
    assert settings["lowbit_merged"] == {"layers": 3, "gemms": 1}
    assert settings["lowbit_calibration_batches"] == 4 and "static_cosine" in settings["lowbit_scaling_check"]
    assert meta.audit["share"][precision] >= 0.5 and meta.flavour == "compiled" and settings["cuda_graphs"]
    if precision == "fp8" and settings["lowbit_scaling"] == "static":  # up, GELU, down: one cuBLASLt call
        assert settings["fp8_epilogue_layers"] == {"linear_bias_gelu_fp8": 1}
    assert settings["gemm_algorithms"] == algorithms
    if algorithms == "measured":
        assert settings["measured_fp8_layers"]["linear_bias_fp8"] >= 1
        chosen = settings["gemm_algorithm_choices"]["algorithms"]
        assert any(key.endswith(",28") for key in chosen)  # E4M3 inputs (cuBLASLt's type 28): the FP8 layers'
    ref = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    name = ref.get_inputs()[0].name
    with load_engine(tmp_path / "e") as runner:
        for batch in (1, 32):
            x = np.random.default_rng(batch).standard_normal((batch, 32, 64)).astype(np.float32)
            got, want = next(iter(runner.infer({name: x}).values())), ref.run(None, {name: x})[0]
            assert float(np.dot(got.ravel(), want.ravel()) / np.linalg.norm(got) / np.linalg.norm(want)) > 0.99
