"""Mixed precision pieces: device/precision resolution, autocast, loss scaling, FP32 norm layers.

Parameters always stay FP32 (master weights): autocast lowers only the ops it lists. The loss is computed
outside autocast on FP32 logits. Norm layers: CUDA autocast already runs layer_norm/group_norm in FP32;
CPU autocast does not (it runs them in bf16/fp16), so :func:`fp32_norms` patches those modules to run in
FP32 when a probe shows autocast would lower them. BatchNorm is left to PyTorch: its weights and running
statistics are FP32 and its kernels accumulate statistics in FP32 for half/bf16 inputs on CPU and cuDNN.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import cache
from typing import Any

import torch
from torch import nn

from kiln.core.errors import TrainingError
from kiln.stages.train.config import AmpConfig, TrainConfig

log = logging.getLogger("kiln.train")

DTYPES: dict[str, torch.dtype] = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# Norms that must compute in FP32. BatchNorm is not here: see the module docstring.
FP32_NORMS: tuple[type[nn.Module], ...] = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)


def resolve_device(cfg: TrainConfig, local_rank: int | None = None) -> torch.device:
    """The device this process trains on; settings that cannot work there are refused here, first."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise TrainingError("train.device is 'cuda' but no CUDA GPU is visible", hint="set train.device: cpu or auto")
    kind = "cuda" if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()) else "cpu"
    if cfg.update_graph == "on" and kind != "cuda":  # said before the data and the model are loaded
        raise TrainingError(
            "train.update_graph: on needs a CUDA device (the update is captured as a CUDA graph); "
            "this run trains on the CPU",
            hint="set train.update_graph: auto (captured where possible) or off",
        )
    if kind == "cuda" and local_rank is not None:
        return torch.device("cuda", local_rank)
    return torch.device(kind)


def resolve_precision(cfg: TrainConfig, device: torch.device) -> str:
    if cfg.precision != "auto":
        if cfg.precision == "fp16" and device.type == "cpu":
            log.warning("fp16 autocast on CPU is slow and rarely useful; bf16 is the CPU mixed precision")
        return cfg.precision
    return "fp16" if device.type == "cuda" else "bf16"


def autocast(device: torch.device, precision: str) -> AbstractContextManager[Any]:
    if precision == "fp32":
        return nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[precision])


def make_scaler(amp: AmpConfig, device: torch.device, precision: str) -> torch.amp.GradScaler:
    """Enabled only for fp16. A static scale starts there and is pinned by :func:`update_scaler`."""
    init = amp.init_scale if amp.loss_scale == "dynamic" else float(amp.loss_scale)
    return torch.amp.GradScaler(
        device.type, init_scale=init, growth_interval=amp.growth_interval, enabled=precision == "fp16"
    )


def update_scaler(scaler: torch.amp.GradScaler, amp: AmpConfig) -> None:
    """Dynamic: grow/back off. Static: GradScaler's documented ``update(new_scale)`` keeps the scale fixed
    (overflowed steps are still skipped by ``scaler.step``)."""
    scaler.update(None if amp.loss_scale == "dynamic" else float(amp.loss_scale))


@cache
def autocast_lowers(norm: type[nn.Module], device_type: str, precision: str) -> bool:
    """Does autocast run this norm type below FP32 on this device? Probed, not assumed: the op lists
    differ per device and per PyTorch release."""
    if precision == "fp32":
        return False
    # No random numbers: the probe runs once per process (cached), between torch.manual_seed and the first
    # step, so drawing from the global RNG would make a run depend on what ran before it in the process.
    # The norms initialise their weights with ones/zeros; the input only needs some spread.
    probe = {
        nn.LayerNorm: lambda: nn.LayerNorm(8),
        nn.GroupNorm: lambda: nn.GroupNorm(2, 8),
        nn.RMSNorm: lambda: nn.RMSNorm(8),
    }[norm]().to(device_type)
    x = torch.linspace(-1.0, 1.0, 64, device=device_type)
    x = x.reshape(2, 8, 4) if norm is nn.GroupNorm else x[:16].reshape(2, 8)
    with torch.no_grad(), torch.autocast(device_type, dtype=DTYPES[precision]):
        return probe(x.to(DTYPES[precision])).dtype != torch.float32


def _fp32_forward(forward: Any) -> Any:
    def run(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            return forward(x.float(), *args, **kwargs)

    return run


@contextmanager
def fp32_norms(model: nn.Module, device: torch.device, precision: str, enabled: bool = True) -> Iterator[list[str]]:
    """Within the block, norm modules that autocast would lower run in FP32 (output FP32, like CUDA autocast's
    layer_norm). Yields the patched module names; the patch is an instance attribute removed on exit."""
    patched: list[tuple[str, nn.Module]] = []
    if enabled:
        for name, mod in model.named_modules():
            kind = next((t for t in FP32_NORMS if isinstance(mod, t)), None)
            if kind is not None and autocast_lowers(kind, device.type, precision):
                mod.forward = _fp32_forward(mod.forward)  # type: ignore[method-assign]
                patched.append((name, mod))
    if patched:
        log.info("running %d norm layers in FP32 (autocast on %s would lower them)", len(patched), device.type)
    try:
        yield [n for n, _ in patched]
    finally:
        for _, mod in patched:
            del mod.forward


def norm_dtypes(
    model: nn.Module, sample: torch.Tensor, device: torch.device, precision: str
) -> dict[str, dict[str, str]]:
    """Output and parameter dtypes of every norm layer in one autocast forward: the check that the
    FP32-norm promise holds for a given model and device."""
    seen: dict[str, dict[str, str]] = {}
    hooks = []
    for name, mod in model.named_modules():
        if isinstance(mod, (*FP32_NORMS, nn.modules.batchnorm._BatchNorm)):

            def hook(m: nn.Module, args: Any, out: torch.Tensor, name: str = name) -> None:
                seen[name] = {
                    "output": str(out.dtype).removeprefix("torch."),
                    "params": sorted({str(p.dtype).removeprefix("torch.") for p in m.parameters()})[0],
                }

            hooks.append(mod.register_forward_hook(hook))
    try:
        with torch.no_grad(), autocast(device, precision):
            model(sample.to(device))
    finally:
        for h in hooks:
            h.remove()
    return seen
