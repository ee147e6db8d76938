"""build.torch.conv_epilogues: BatchNorm folded into convolutions, and convolution + bias (+ residual add) + ReLU as
one cuDNN call, through two custom ops the compiled flavour's program is rewritten to. The speed is the GPU's
(benchmarks/conv_epilogue_probe.py); here: the rewrite finds the right layers, leaves the wrong ones, computes the
same function (the ops compute it unfused on the CPU), and survives torch.compile and a build + reload."""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from kiln.models.registry import build_model
from kiln.stages.engines.config import BuildConfig
from kiln.stages.engines.registry import load_engine
from kiln.stages.engines.stage import build_engine
from kiln.stages.engines.torch.build import _settings
from kiln.stages.engines.torch.config import TorchConfig
from kiln.stages.engines.torch.conv_epilogues import fuse_conv_epilogues, resolve
from tests.stages.engines.build_graphs import assert_engine_matches, assert_runner_agrees, sample

FUSED = ("kiln.conv_bias_relu.default", "kiln.conv_bias_add_relu.default")


def _ops(gm: torch.fx.GraphModule) -> Counter:
    return Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


def _exported(model: nn.Module, *args: torch.Tensor) -> torch.fx.GraphModule:
    with torch.inference_mode():
        return torch.export.export(model.eval(), args).module()


def _trained_statistics(model: nn.Module) -> nn.Module:
    """BatchNorms with running statistics and affine parameters away from their defaults (1, 0), so that a wrong
    fold shows in the outputs."""
    torch.manual_seed(1)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.2, 0.2)
    return model.eval()


def test_a_resnet_becomes_one_fused_call_per_convolution_and_keeps_its_function() -> None:
    """Kiln's ResNet (torchvision's block: in-place ReLU, ``out += identity``, a BatchNorm'd downsampling branch):
    every BatchNorm folded, every convolution followed by a ReLU fused, the downsampling convolutions (no ReLU after
    them) folded only."""
    torch.manual_seed(0)
    model = _trained_statistics(build_model("resnet18", {"width": 8, "blocks": (1, 1), "num_classes": 10}))
    x = torch.randn(2, 3, 32, 32)
    gm = _exported(model, x)
    norms = sum(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    down = sum(isinstance(m, nn.Conv2d) and ".down" in name for name, m in model.named_modules())
    blocks = sum(type(m).__name__ == "BasicBlock" for m in model.modules())
    counts = fuse_conv_epilogues(gm)
    assert counts == {"batch_norms_folded": norms, "conv_bias_relu": 1 + blocks, "conv_bias_add_relu": blocks}
    assert down >= 1  # the downsampling branch is there, and its convolution stayed a plain (folded) one
    ops = _ops(gm)
    assert "aten.batch_norm.default" not in ops and ops["aten.conv2d.default"] == down
    assert "aten.relu_.default" not in ops and "aten.add_.Tensor" not in ops
    names = {name for name, _ in (*gm.named_parameters(), *gm.named_buffers())}
    assert not any(name.endswith("running_var") for name in names)  # the folded layers' tensors are gone
    with torch.inference_mode():
        torch.testing.assert_close(gm(x), model(x), atol=1e-5, rtol=1e-5)
        compiled = torch.compile(gm, dynamic=False)  # Inductor compiles around the custom ops
        torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)


class NotFusable(nn.Module):
    """Three convolutions the epilogue must not take, and the BatchNorm folds it still may."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (nn.Conv2d(4, 4, 3, padding=1) for _ in range(3))
        self.bn = nn.BatchNorm2d(4)
        self.shift = nn.Parameter(torch.randn(1, 4, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.a(x)
        twice = torch.relu(a) + a  # read twice: the ReLU is not the only reader
        h = torch.sigmoid(x)
        h += self.bn(self.b(x))  # an in-place add into the other operand, which it returns
        broadcast = torch.relu(self.c(x) + self.shift)  # a [1, C, 1, 1] residual: not cuDNN's fused add
        return twice + torch.relu(h) + broadcast


def test_what_the_pattern_does_not_hold_is_left_as_it_is() -> None:
    torch.manual_seed(0)
    model, x = _trained_statistics(NotFusable()), torch.randn(2, 4, 8, 8)
    gm = _exported(model, x)
    counts = fuse_conv_epilogues(gm)
    assert counts == {"batch_norms_folded": 1, "conv_bias_relu": 0, "conv_bias_add_relu": 0}
    assert not any(op in _ops(gm) for op in FUSED)
    with torch.inference_mode():
        torch.testing.assert_close(gm(x), model(x), atol=1e-5, rtol=1e-5)


def test_a_convolution_with_its_own_bias_and_relu_is_fused_without_a_batch_norm() -> None:
    model, x = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.ReLU()), torch.randn(2, 3, 9, 9)
    gm = _exported(model, x)
    assert fuse_conv_epilogues(gm) == {"batch_norms_folded": 0, "conv_bias_relu": 1, "conv_bias_add_relu": 0}
    node = next(n for n in gm.graph.nodes if str(n.target) == FUSED[0])
    assert node.args[3:] == ([2, 2], [1, 1], [1, 1], 1)  # stride, padding, dilation, groups as the layer has them
    with torch.inference_mode():
        torch.testing.assert_close(gm(x), model(x), atol=1e-5, rtol=1e-5)


def test_a_same_padded_convolution_is_folded_but_not_fused() -> None:
    """``padding='same'`` (EfficientNet's convolutions, ``aten.conv2d.padding``): the BatchNorm folds into it, but the
    fused ops take integer padding only, so its ReLU stays a kernel of its own."""
    torch.manual_seed(0)
    model = _trained_statistics(
        nn.Sequential(nn.Conv2d(3, 8, 3, padding="same", bias=False), nn.BatchNorm2d(8), nn.ReLU())
    )
    x = torch.randn(2, 3, 7, 7)
    gm = _exported(model, x)
    assert fuse_conv_epilogues(gm) == {"batch_norms_folded": 1, "conv_bias_relu": 0, "conv_bias_add_relu": 0}
    assert _ops(gm)["aten.conv2d.padding"] == 1 and "aten.batch_norm.default" not in _ops(gm)
    with torch.inference_mode():
        torch.testing.assert_close(gm(x), model(x), atol=1e-5, rtol=1e-5)


def test_folding_keeps_the_weights_dtype_and_channels_last_layout() -> None:
    """The engine's weights are FP16 and channels_last on the GPU: the folded ones must be too (cuDNN would copy a
    weight of the other layout on every call). Folding is computed in FP32."""
    torch.manual_seed(0)
    model = _trained_statistics(nn.Sequential(nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d(8)))
    model = model.to(memory_format=torch.channels_last)
    gm = _exported(model, torch.randn(1, 3, 6, 6).contiguous(memory_format=torch.channels_last))
    assert fuse_conv_epilogues(gm)["batch_norms_folded"] == 1
    weight = gm._kiln_folded_conv_0_weight
    assert weight.is_contiguous(memory_format=torch.channels_last) and weight.dtype == torch.float32
    half = _trained_statistics(nn.Sequential(nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d(8))).half()
    gm16 = torch.export.export(half, (torch.randn(1, 3, 6, 6).half(),)).module()
    fuse_conv_epilogues(gm16)
    want, _ = torch.nn.utils.fusion.fuse_conv_bn_weights(
        *(t.float() for t in (half[0].weight, torch.zeros(8), half[1].running_mean, half[1].running_var)),
        half[1].eps,
        half[1].weight.float(),
        half[1].bias.float(),
    )
    assert gm16._kiln_folded_conv_0_weight.dtype == torch.float16
    torch.testing.assert_close(gm16._kiln_folded_conv_0_weight.float(), want.half().float(), atol=0, rtol=0)


@pytest.mark.parametrize(
    "device, precision, flavour, applies",
    [
        ("cuda", "fp16", "auto", True),
        ("cuda", "fp16", "compiled", True),
        ("cuda", "fp16", "aotinductor", False),
        ("cuda", "fp32", "auto", False),
        ("cpu", "fp32", "auto", False),
    ],
)
def test_auto_means_fp16_gpu_engines_of_models_with_convolutions(
    device: str, precision: str, flavour: str, applies: bool
) -> None:
    assert TorchConfig().conv_epilogues == "auto"
    assert resolve("auto", device, precision, flavour) is applies
    assert _settings(TorchConfig(flavour=flavour), device, precision, has_conv=True)["conv_epilogues"] is applies
    assert _settings(TorchConfig(flavour=flavour), device, precision, has_conv=False)["conv_epilogues"] is False
    assert resolve("on", device, precision, flavour) and not resolve("off", device, precision, flavour)


def test_on_refuses_the_aotinductor_flavour_when_the_config_is_read() -> None:
    with pytest.raises(ValidationError, match="conv_epilogues needs flavour compiled or auto"):
        TorchConfig(flavour="aotinductor", conv_epilogues="on")


def test_only_an_explicit_setting_warns_when_there_is_nothing_to_rewrite(caplog: pytest.LogCaptureFixture) -> None:
    model, x = nn.Sequential(nn.Linear(4, 4), nn.ReLU()), torch.randn(2, 4)
    for warn in (False, True):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kiln.build"):
            fuse_conv_epilogues(_exported(model, x), warn_if_none=warn)
        assert ("no 2-D convolution followed by" in caplog.text) is warn


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return build_model("cnn", {}).eval()


def test_a_compiled_engine_with_conv_epilogues_matches_pytorch_and_records_its_layers(zoo, tmp_path: Path) -> None:
    cfg = BuildConfig(backends=["torch"], torch=TorchConfig(conv_epilogues="on"))  # flavour auto
    meta = build_engine(
        zoo("cnn"), tmp_path / "e", "torch", "cpu", "fp32", cfg, tmp_path / "c", max_batch=4, torch_model=_cnn
    )
    assert meta.flavour == "compiled"  # auto goes straight to the flavour that can hold the custom ops
    settings = meta.builder_settings
    depth = sum(isinstance(m, nn.Conv2d) for m in _cnn().modules())
    assert settings["conv_epilogues"] is True
    assert settings["conv_epilogue_layers"] == {
        "batch_norms_folded": depth,
        "conv_bias_relu": depth,
        "conv_bias_add_relu": 0,
    }
    torch.compiler.reset()  # the runner rewrites and compiles again in a process that has not seen the model
    assert_engine_matches(tmp_path / "e", _cnn(), "cnn", (1, 4))


def test_a_model_whose_fused_convolutions_fail_gets_its_engine_without_them(
    zoo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """auto turns the rewrite on for an engine kind, not for a model: where it breaks the build (cuDNN refusing a
    fused call, say) the engine is built without it and says why; an explicit `on` fails as asked."""
    from kiln.core.errors import BuildError
    from kiln.stages.engines.torch import conv_epilogues

    def broken(gm: torch.fx.GraphModule, warn_if_none: bool = True) -> dict[str, int]:
        raise RuntimeError("cuDNN Error: CUDNN_STATUS_NOT_SUPPORTED")

    monkeypatch.setattr(conv_epilogues, "fuse_conv_epilogues", broken)
    monkeypatch.setattr(conv_epilogues, "resolve", lambda *args: True)  # auto applies, as for an FP16 GPU engine
    cfg = BuildConfig(backends=["torch"], torch=TorchConfig(flavour="compiled"))
    meta = build_engine(
        zoo("cnn"), tmp_path / "e", "torch", "cpu", "fp32", cfg, tmp_path / "c", max_batch=2, torch_model=_cnn
    )
    settings = meta.builder_settings
    assert settings["conv_epilogues"] is False and "CUDNN_STATUS_NOT_SUPPORTED" in settings["conv_epilogues_failed"]
    assert "conv_epilogue_layers" not in settings
    assert_engine_matches(tmp_path / "e", _cnn(), "cnn", (1, 2))
    explicit = BuildConfig(backends=["torch"], torch=TorchConfig(flavour="compiled", conv_epilogues="on"))
    with pytest.raises(BuildError, match="CUDNN_STATUS_NOT_SUPPORTED"):
        build_engine(
            zoo("cnn"), tmp_path / "f", "torch", "cpu", "fp32", explicit, tmp_path / "c", max_batch=2, torch_model=_cnn
        )


def _resnet() -> nn.Module:
    torch.manual_seed(0)
    return _trained_statistics(
        build_model("resnet18", {"width": 16, "blocks": (1, 1), "num_classes": 10, "in_channels": 1})
    )


@pytest.mark.gpu
@pytest.mark.timeout(900)  # max-autotune still tunes what is not fused (pooling, the classifier)
def test_cuda_fp16_engine_with_cudnn_epilogues_agrees_and_replays_graphs(zoo, tmp_path: Path) -> None:
    """On the GPU (auto for FP16) the ops are cuDNN's fused convolution + bias (+ add) + ReLU inside Kiln's CUDA
    graphs; the engine agrees with the FP32 model at batch 1 and 32. The model: a small ResNet (residual adds) with
    the zoo CNN's signature ([B, 1, 8, 8] -> [B, 10]), built against the zoo CNN's graph for its inputs and outputs."""
    cfg = BuildConfig(backends=["torch"], torch=TorchConfig(devices=["cuda"]))
    meta = build_engine(
        zoo("cnn"), tmp_path / "e", "torch", "cuda", "fp16", cfg, tmp_path / "c", max_batch=32, torch_model=_resnet
    )
    assert meta.flavour == "compiled" and meta.builder_settings["cuda_graphs"]
    layers = meta.builder_settings["conv_epilogue_layers"]
    assert layers["conv_bias_relu"] >= 2 and layers["conv_bias_add_relu"] >= 1, layers
    with load_engine(tmp_path / "e") as runner:
        assert_runner_agrees(runner, _resnet(), "cnn", (1, 32))
        assert runner.prepared({runner.input_names[0]: sample("cnn", 32)})[1]  # a CUDA graph per batch size
