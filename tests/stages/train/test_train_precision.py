"""Mixed precision: FP32 master weights and norms, loss scaling (dynamic and static), overflow counting."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from kiln.stages.train import checkpoint as ckpt
from kiln.stages.train.config import AmpConfig
from kiln.stages.train.loop import train
from kiln.stages.train.precision import autocast_lowers, fp32_norms, make_scaler, norm_dtypes, update_scaler
from tests.stages.train.train_helpers import tiny_data, tiny_net, train_cfg

CPU = torch.device("cpu")


def test_norms_run_in_fp32_under_bf16_autocast() -> None:
    model = nn.Sequential(
        nn.Flatten(),
        nn.Linear(64, 16),
        nn.LayerNorm(16),
        nn.Linear(16, 8),
        nn.Unflatten(1, (8, 1)),
        nn.GroupNorm(2, 8),
        nn.Flatten(),
        nn.Linear(8, 4),
    )
    sample = torch.randn(4, 1, 8, 8)
    before = norm_dtypes(model, sample, CPU, "bf16")
    with fp32_norms(model, CPU, "bf16") as patched:
        after = norm_dtypes(model, sample, CPU, "bf16")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(sample)
    assert out.dtype == torch.bfloat16  # the Linear after the norms still runs in bf16: only norms are FP32
    if autocast_lowers(nn.LayerNorm, "cpu", "bf16"):  # CPU autocast lowers layer_norm (CUDA's does not)
        assert before["2"]["output"] == "bfloat16"
        assert patched == ["2", "5"]
    assert after["2"] == {"output": "float32", "params": "float32"}
    assert after["5"] == {"output": "float32", "params": "float32"}
    assert "forward" not in vars(model[2])  # the patch is gone after the block


@pytest.mark.slow
def test_bf16_training_keeps_fp32_master_weights_and_reports_norms() -> None:
    model = tiny_net()
    result = train(model, tiny_data(), train_cfg(precision="bf16", epochs=1))
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert result.precision == "bf16"
    assert result.fp32_norms == (["net.2"] if autocast_lowers(nn.LayerNorm, "cpu", "bf16") else [])
    assert result.history[0].loss_scale is None


def _scaled_step(scaler: torch.amp.GradScaler, amp: AmpConfig, grad: float) -> None:
    p = nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler.scale((p * grad).sum()).backward()
    scaler.step(opt)
    update_scaler(scaler, amp)


def test_dynamic_scale_backs_off_on_overflow_and_grows() -> None:
    amp = AmpConfig(init_scale=1024.0, growth_interval=2)
    scaler = make_scaler(amp, CPU, "fp16")
    _scaled_step(scaler, amp, float("inf"))
    assert scaler.get_scale() == 512.0
    _scaled_step(scaler, amp, 1.0)
    _scaled_step(scaler, amp, 1.0)
    assert scaler.get_scale() == 1024.0


def test_static_scale_never_changes() -> None:
    amp = AmpConfig(loss_scale=128.0)
    scaler = make_scaler(amp, CPU, "fp16")
    for g in (float("inf"), 1.0, 1.0, float("nan")):
        _scaled_step(scaler, amp, g)
        assert scaler.get_scale() == 128.0


def test_scaler_disabled_outside_fp16() -> None:
    assert not make_scaler(AmpConfig(), CPU, "bf16").is_enabled()
    assert not make_scaler(AmpConfig(), CPU, "fp32").is_enabled()


def test_fp16_overflow_steps_are_skipped_and_counted() -> None:
    # A huge initial scale overflows fp16 gradients: the scaler must skip those steps and back off until
    # the scale fits; the weights must stay finite throughout.
    model = tiny_net()
    cfg = train_cfg(precision="fp16", epochs=2, amp={"init_scale": 2.0**60, "growth_interval": 1000})
    result = train(model, tiny_data(), cfg)
    skipped = sum(m.skipped_steps for m in result.history)
    assert skipped >= 1
    assert result.history[-1].loss_scale < 2.0**60
    assert result.history[-1].nonfinite_steps == 0
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_fp16_back_offs_on_finite_losses_neither_abort_nor_block_checkpoints(tmp_path: Path) -> None:
    """init_scale 2^60 takes dozens of back-offs, each a skipped step with a finite loss: that is loss scaling
    at work, not the NaN/Inf losses nonfinite_patience counts; and the weights are unchanged, so the
    checkpoints during the back-offs are good ones."""
    seen: list[int] = []

    def watch(step: int) -> None:
        if step == 5:  # one back-off after the checkpoint of step 4, all steps so far backed off
            seen.append(json.loads((tmp_path / ckpt.INFO).read_text())["global_step"])

    cfg = train_cfg(
        precision="fp16", epochs=2, amp={"init_scale": 2.0**60, "nonfinite_patience": 2}, checkpoint={"every_steps": 2}
    )
    r = train(tiny_net(), tiny_data(), cfg, ckpt_dir=tmp_path, run_key="k", on_step=watch)
    assert sum(m.skipped_steps for m in r.history) == 10 and sum(m.nonfinite_steps for m in r.history) == 0
    assert seen == [4]
    assert ckpt.load_state(tmp_path / ckpt.LAST)["complete"]


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # torch's, from the RMSNorm probe
def test_fp32_norm_probe_leaves_the_global_rng_alone() -> None:
    """The probe runs once per process (cached): drawing from the seeded global RNG would make a run depend
    on whether another run came before it in the same process."""
    autocast_lowers.cache_clear()
    torch.manual_seed(0)
    before = torch.get_rng_state()
    for norm in (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm):
        autocast_lowers(norm, "cpu", "bf16")
    assert torch.equal(before, torch.get_rng_state())


def test_invalid_static_scale_is_a_config_error() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        AmpConfig(loss_scale=-1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_cuda_autocast_keeps_layernorm_fp32_and_trains(precision: str) -> None:
    cuda = torch.device("cuda")
    assert not autocast_lowers(nn.LayerNorm, "cuda", precision)  # CUDA autocast lists layer_norm as FP32
    model = tiny_net().to(cuda)
    seen = norm_dtypes(model, torch.randn(4, 1, 8, 8), cuda, precision)
    assert seen["net.2"] == {"output": "float32", "params": "float32"}
    result = train(model, tiny_data(), train_cfg(precision=precision, device="cuda", epochs=1))
    assert result.fp32_norms == []
    assert (result.history[0].loss_scale is not None) == (precision == "fp16")
    assert result.history[0].peak_memory_mb > 0
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in model.parameters())


class NanGradNet(nn.Module):
    """A finite loss whose gradient is NaN on every step (sqrt'(0) * 0): a real bug, not a loss-scale overflow."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.p = nn.Linear(64, 10), nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.flatten(1)) + torch.sqrt(self.p * 0.0)


@pytest.mark.parametrize("amp", [{"init_scale": 2.0**4}, {"loss_scale": 8.0}])
def test_fp16_nan_gradients_on_finite_losses_still_abort(amp: dict) -> None:
    """Back-offs are forgiven only while the dynamic scale can still be the cause (>= 1): a static scale, or one
    halved below 1, means the gradients are NaN by themselves, and the run must stop (it once skipped forever)."""
    from kiln.core.errors import TrainingError

    cfg = train_cfg(precision="fp16", epochs=4, amp={**amp, "nonfinite_patience": 3})
    with pytest.raises(TrainingError, match="consecutive steps|no step updated the weights"):
        train(NanGradNet(), tiny_data(), cfg)
