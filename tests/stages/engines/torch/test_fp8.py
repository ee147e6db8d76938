"""FP8 linear layers (torch engine): E4M3 weights and activations, one scale per row, through torch._scaled_mm."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kiln.stages.engines.torch.fp8 import Fp8Linear, fp8_supported, to_fp8


def test_an_fp8_linear_agrees_with_its_linear() -> None:
    """PyTorch runs rowwise-scaled _scaled_mm on the CPU too: the layer's numerics are checked here."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 32)
    x = torch.randn(3, 5, 64)
    got = Fp8Linear(linear)(x.to(torch.bfloat16)).float()
    want = linear(x)
    cos = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)
    assert got.shape == want.shape and cos > 0.998  # E4M3: 3 mantissa bits, scaled per row


def test_only_layers_fp8_gemms_take_are_swapped() -> None:
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10), nn.Linear(10, 16))
    report = to_fp8(model, exclude=["3"])
    assert isinstance(model[0], Fp8Linear) and isinstance(model[2], nn.Linear) and isinstance(model[3], nn.Linear)
    assert report["fp8_layers"] == 1 and "multiples of 16" in report["fp8_kept"]["2"]
    assert report["fp8_kept"]["3"] == "listed in build.torch.fp8_exclude"


def test_no_fp8_gpu_is_a_skip_line() -> None:
    why = fp8_supported()
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9):
        pytest.skip("this machine has FP8 tensor cores")
    assert why and ("no FP8 tensor cores" in why or "sees none" in why)


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_fp8_engine_of_a_small_transformer(zoo, tmp_path) -> None:
    """The torch backend's FP8 engine on a GPU with FP8 tensor cores: its linear layers are FP8 GEMMs (the audit
    says which share of the FLOPs), and it agrees with the FP32 graph; elsewhere the plan skips it with a reason."""
    import numpy as np
    import onnxruntime as ort

    from kiln.models.registry import build_model
    from kiln.stages.engines.config import BuildConfig
    from kiln.stages.engines.registry import load_engine
    from kiln.stages.engines.stage import build_engine
    from kiln.stages.engines.torch import _plan
    from kiln.stages.engines.torch.config import TorchConfig
    from tests.stages.engines.build_graphs import ZOO, sample

    plan = _plan(TorchConfig(devices=["cuda"]), "fp8")
    if why := fp8_supported():
        assert not plan.devices and why in plan.skipped[-1]
        pytest.skip(why)

    def transformer() -> torch.nn.Module:
        torch.manual_seed(0)
        return build_model("transformer", ZOO["transformer"][0]).eval()

    cfg = BuildConfig(backends=["torch"], torch=TorchConfig(devices=["cuda"], max_autotune="off"))  # correctness here
    src = zoo("transformer")
    meta = build_engine(src, tmp_path / "e", "torch", "cuda", "fp8", cfg, tmp_path / "c", torch_model=transformer)
    assert meta.builder_settings["fp8_layers"] > 0 and meta.audit["share"]["fp8"] >= 0.5
    ref = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    with load_engine(tmp_path / "e") as runner:
        x = sample("transformer", 32, seed=1)
        got, want = runner.infer({"input": x})["logits"], ref.run(None, {"input": x})[0]
        assert float(np.dot(got.ravel(), want.ravel()) / np.linalg.norm(got) / np.linalg.norm(want)) > 0.99
        assert np.mean(got.argmax(-1) == want.argmax(-1)) >= 0.9
