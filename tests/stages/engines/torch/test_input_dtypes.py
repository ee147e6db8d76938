"""The torch engine's inputs of other dtypes than float32: float64 reaches the model as float64 (an FP32 engine cast
it to float32 first), and a float16 engine runs a model that makes float32 tensors itself under ``torch.autocast``
(its own ``.float()`` met float16 weights and the build failed), but only for a dtype clash; 16-bit float outputs
come back as float32."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from kiln.core.errors import BuildError
from kiln.core.records import TensorSpec
from kiln.stages.engines.backend import BuildRequest
from kiln.stages.engines.config import BuildConfig
from kiln.stages.engines.registry import load_engine
from kiln.stages.engines.stage import build_engine
from kiln.stages.engines.torch.build import _autocast_reason, _capture, _fails, _served
from kiln.stages.engines.torch.config import TorchConfig
from kiln.stages.export.torch_export import export_onnx
from tests.pipeline.test_faults import invoke

EARTH = 6.371e6  # metres: float32 keeps 0.5 m steps here, float64 far below a millimetre


class Geo(nn.Module):
    """Coordinates near the Earth's radius, centred in float64 and only then cast to float32; a float64 output."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 4)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"offset": self.lin((x - EARTH).float()), "radius": x.norm(dim=-1)}


class Img(nn.Module):
    """A uint8 NHWC image the model scales to [0, 1] itself."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x.permute(0, 3, 1, 2).float() / 255).relu().mean((2, 3))


class Lerp(nn.Module):
    """Mixes a float32 tensor of its own with a weight: fails with float16 weights, under autocast too."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.lerp(x.float(), self.w, 0.5)


class Spectrum(nn.Module):
    """An FFT: no float16 kernel on the CPU ("Unsupported dtype Half"), no dtype clash."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.fft.rfft(x).abs())


class Inverse(nn.Module):
    """A matrix inverse: torch.linalg refuses float16 ("Low precision dtypes not supported")."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(9, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eye = 3 * torch.eye(3, dtype=x.dtype)
        return self.lin(torch.linalg.inv(x.view(-1, 3, 3) + eye).flatten(1))


class Indexed(nn.Module):
    """Reads past its input's end: an IndexError in any dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x[:, [0, 1, 7]])


class Brain(nn.Module):
    """Returns a bfloat16 tensor of its own beside its float32 result."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lin(x), x.to(torch.bfloat16)


def _coordinates(batch: int, seed: int = 0) -> np.ndarray:
    return EARTH + np.random.default_rng(seed).uniform(-5.0, 5.0, (batch, 3))


def _image(batch: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (batch, 8, 8, 3)).astype(np.uint8)


SPECS = {
    Geo: TensorSpec(name="input", shape=["batch", 3], dtype="float64"),
    Img: TensorSpec(name="input", shape=["batch", 8, 8, 3], dtype="uint8"),
    Lerp: TensorSpec(name="input", shape=["batch", 3], dtype="float64"),
}
SAMPLES = {Geo: _coordinates, Img: _image, Lerp: _coordinates}


def _request(tmp_path: Path, model: type, precision: str) -> BuildRequest:
    return BuildRequest(
        tmp_path / "m.onnx",
        tmp_path,
        "cpu",
        precision,
        TorchConfig(),
        tmp_path,
        [SPECS[model]],
        max_batch=4,
        name=f"torch-cpu-{precision}",
    )


def _eager(model: nn.Module, x: np.ndarray) -> list[torch.Tensor]:
    with torch.inference_mode():
        out = model(torch.from_numpy(x))
    return list(out.values()) if isinstance(out, dict) else [out]


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0))


def test_an_fp32_engine_passes_float64_inputs_and_outputs_unchanged() -> None:
    """Cast to float32 before the model, the coordinates lost their metres (0.1 off here); now the served model
    computes what the model does, bit for bit, and a float64 output stays float64."""
    model, x = Geo().eval(), _coordinates(4)
    with torch.inference_mode():
        got = _served(model, ["input"], "fp32", False)(torch.from_numpy(x))
    want = _eager(model, x)
    assert torch.equal(got[0], want[0])  # the old cast: 0.1 off
    assert got[1].dtype == torch.float64 and torch.equal(got[1], want[1])


@pytest.mark.parametrize(("model", "error"), [(Geo, "same dtype"), (Img, "should be the same")])
def test_a_float16_engine_runs_a_model_that_casts_inside_under_autocast(
    tmp_path: Path, model: type, error: str
) -> None:
    """With float16 weights the model's own float32 tensors meet them and fail; under autocast the convolution or
    matrix multiply takes them in float16. The float64 coordinates are not cast to float16 (6.4e6 is past its
    largest value, 65504: inf). The captured graph holds the layers themselves, not an autocast submodule, so the
    graph rewrites see them."""
    eager, x = model().eval(), SAMPLES[model](2)
    half = model().eval().half()
    req = _request(tmp_path, model, "fp16")
    args = (torch.from_numpy(x),)
    reason = _autocast_reason(half, req, args)
    assert reason is not None and error in reason
    with torch.inference_mode():
        got = _served(half, ["input"], "fp16", False, autocast="cpu")(*args)
    for g, w in zip(got, _eager(eager, x)):
        assert g.dtype == w.dtype and torch.isfinite(g).all() and _cosine(g, w) > 0.9999
    settings = {"channels_last": False, "channels_last_weights": False, "autocast": True}
    exported, _, _ = _capture(half, req, args, settings)
    targets = {str(n.target) for n in exported.graph.nodes if n.op == "call_function"}
    assert not any("autocast" in t for t in targets)
    assert targets & {"aten.linear.default", "aten.conv2d.default"}
    with torch.inference_mode():
        captured = exported.module()(*args)
    assert all(torch.allclose(c, g) for c, g in zip(captured, got))


def test_a_model_that_runs_in_float16_or_float32_is_not_autocast(tmp_path: Path) -> None:
    plain = nn.Sequential(nn.Linear(3, 4)).eval()
    x = (torch.randn(2, 3),)
    spec = TensorSpec(name="input", shape=["batch", 3], dtype="float32")
    req = BuildRequest(tmp_path, tmp_path, "cpu", "fp16", TorchConfig(), tmp_path, [spec], name="torch-cpu-fp16")
    assert _autocast_reason(plain.half(), req, x) is None
    assert _autocast_reason(Img().eval(), _request(tmp_path, Img, "fp32"), (torch.from_numpy(_image(2)),)) is None


def test_a_model_that_fails_under_autocast_too_is_a_build_error(tmp_path: Path) -> None:
    """The build stage skips a torch engine whose build raises a BuildError, and lists it with this reason."""
    args = (torch.from_numpy(_coordinates(2)),)
    with pytest.raises(BuildError, match=r"float16 \(.*\), nor under torch.autocast \(.*`end`") as err:
        _autocast_reason(Lerp().eval().half(), _request(tmp_path, Lerp, "fp16"), args)
    assert "weight.dtype" in (err.value.hint or "")


@pytest.mark.parametrize(("model", "width", "error"), [(Spectrum, 8, "Half"), (Inverse, 9, "Low precision")])
def test_a_float16_failure_without_a_dtype_clash_is_a_build_error_not_autocast(
    tmp_path: Path, model: type, width: int, error: str
) -> None:
    """Under autocast the FFT and the inverse ran in float32 and the engine was built as "fp16"; now the error
    stands, with no hint to cast."""
    spec = TensorSpec(name="input", shape=["batch", width], dtype="float32")
    req = BuildRequest(tmp_path, tmp_path, "cpu", "fp16", TorchConfig(), tmp_path, [spec], name="torch-cpu-fp16")
    with pytest.raises(BuildError, match=error) as err:
        _autocast_reason(model().eval().half(), req, (torch.randn(2, width),))
    assert "torch.autocast" not in str(err.value) and "cast inside" not in (err.value.hint or "")


def test_an_index_error_is_no_dtype_problem(tmp_path: Path) -> None:
    spec = TensorSpec(name="input", shape=["batch", 3], dtype="float32")
    req = BuildRequest(tmp_path, tmp_path, "cpu", "fp16", TorchConfig(), tmp_path, [spec], name="torch-cpu-fp16")
    with pytest.raises(BuildError, match="IndexError") as err:
        _autocast_reason(Indexed().eval().half(), req, (torch.randn(2, 3),))
    assert "cast inside" not in (err.value.hint or "")


def test_running_out_of_memory_propagates_as_it_came(tmp_path: Path) -> None:
    def exhausted(x: torch.Tensor) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(torch.OutOfMemoryError):
        _fails(exhausted, (torch.randn(2, 3),))


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_bfloat16_outputs_come_back_as_float32(precision: str) -> None:
    """Left bfloat16, the runner's ``.numpy()`` failed ("Got unsupported ScalarType BFloat16")."""
    model = Brain().eval() if precision == "fp32" else Brain().eval().half()
    with torch.inference_mode():
        got = _served(model, ["input"], precision, False)(torch.randn(2, 3))
    assert [g.dtype for g in got] == [torch.float32, torch.float32]
    got[1].numpy()


def _built(tmp_path: Path, model: type, precision: str, x: np.ndarray) -> Any:
    """The model exported to ONNX and built as a CPU torch engine of the compiled flavour."""
    export_onnx(model().eval(), torch.from_numpy(x), tmp_path / "m.onnx")
    cfg = BuildConfig(backends=["torch"], torch=TorchConfig(flavour="compiled"))
    return build_engine(
        tmp_path / "m.onnx",
        tmp_path / "e",
        "torch",
        "cpu",
        precision,
        cfg,
        tmp_path / "c",
        max_batch=4,
        torch_model=model,
    )


@pytest.mark.slow  # Inductor compiles C++
def test_an_fp32_cpu_engine_of_a_float64_model_matches_pytorch(tmp_path: Path) -> None:
    meta = _built(tmp_path, Geo, "fp32", _coordinates(4))
    assert [i.dtype for i in meta.inputs] == ["float64"] and "autocast" not in meta.builder_settings
    model = Geo().eval()
    with load_engine(tmp_path / "e") as runner:
        for batch in (1, 4):
            x = _coordinates(batch, seed=batch)
            got = runner.infer({"input": x})
            want = _eager(model, x)
            np.testing.assert_allclose(got["offset"], want[0].numpy(), atol=1e-6, rtol=1e-6)  # the old cast: 0.1 off
            assert got["radius"].dtype == np.float64
            np.testing.assert_allclose(got["radius"], want[1].numpy(), rtol=1e-12)


@pytest.mark.slow  # Inductor compiles C++
def test_a_cpu_fp16_engine_of_a_uint8_image_model_builds_under_autocast(tmp_path: Path) -> None:
    """CPU FP16 torch engines are not planned (the GPU's are); built here, they take the same path."""
    meta = _built(tmp_path, Img, "fp16", _image(4))
    assert meta.builder_settings["autocast"] is True and "Half" in meta.builder_settings["autocast_reason"]
    model = Img().eval()
    with load_engine(tmp_path / "e") as runner:
        for batch in (1, 4):
            x = _image(batch, seed=batch)
            got = torch.from_numpy(runner.infer({"input": x})["logits"])
            assert got.dtype == torch.float32 and _cosine(got, _eager(model, x)[0]) > 0.9999
    np.savez(tmp_path / "x.npz", input=_image(4, seed=9))
    out = invoke("validate", tmp_path / "e", "--reference", tmp_path / "m.onnx", "--inputs", tmp_path / "x.npz")
    assert out.exit_code == 0, out.output
    checked = json.JSONDecoder().raw_decode(out.output[out.output.index("{\n") :])[0]
    assert checked["precision"] == "fp16" and checked["autocast"] is True  # not float16 throughout: said so


@pytest.mark.gpu
@pytest.mark.slow
def test_a_cuda_fp16_engine_under_autocast_keeps_its_convolution_rewrites(tmp_path: Path) -> None:
    """The autocast submodule inlined: the convolution rewrite finds the convolution and its ReLU."""
    export_onnx(Img().eval(), torch.from_numpy(_image(4)), tmp_path / "m.onnx")
    cfg = BuildConfig(backends=["torch"], torch=TorchConfig(devices=["cuda"]))
    meta = build_engine(
        tmp_path / "m.onnx", tmp_path / "e", "torch", "cuda", "fp16", cfg, tmp_path / "c", max_batch=4, torch_model=Img
    )
    assert meta.builder_settings["autocast"] is True
    assert meta.builder_settings["conv_epilogue_layers"]["conv_bias_relu"] == 1
    model = Img().eval()
    with load_engine(tmp_path / "e") as runner:
        x = _image(4, seed=4)
        got = torch.from_numpy(runner.infer({"input": x})["logits"])
        assert _cosine(got, _eager(model, x)[0]) > 0.999
