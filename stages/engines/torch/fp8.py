"""FP8 linear layers for the torch engine: E4M3 weights with one scale per output row (from the trained weights),
activations scaled per row when they arrive (dynamic: no calibration), multiplied by ``torch._scaled_mm`` into
bfloat16, which Inductor compiles to FP8 tensor-core GEMMs on GPUs that have them (compute capability 8.9+:
Ada, Hopper). The rest of the model runs in bfloat16.

Rowwise scaling is what keeps E4M3's 3 mantissa bits usable without calibration (torchao's float8 inference and
ModelOpt's FP8 recipes scale the same way); torchao is not a dependency here, so the layer is these few lines around
PyTorch's own ``_scaled_mm``. A layer whose input or output width is not a multiple of 16 (what ``_scaled_mm``
takes), or that is named in ``build.torch.fp8_exclude``, stays in bfloat16.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (8.9) and Hopper (9.0) on


def fp8_supported() -> str | None:
    """None where this machine's GPU has FP8 tensor cores; else why not (a skip line, not a failure)."""
    if not torch.cuda.is_available():
        return "FP8 engines need a CUDA GPU; torch sees none"
    capability = torch.cuda.get_device_capability()
    if capability < MIN_CAPABILITY:
        name = torch.cuda.get_device_name()
        return f"{name} (compute capability {capability[0]}.{capability[1]}) has no FP8 tensor cores (8.9+)"
    return None


def rowwise(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` [rows, k] as E4M3 with one float32 scale per row ([rows, 1]): ``t ~ fp8 * scale``."""
    scale = t.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / E4M3_MAX
    return (t.float() / scale).to(torch.float8_e4m3fn), scale


class Fp8Linear(nn.Module):
    """``nn.Linear`` as an FP8 GEMM: weights quantized once per output row, activations per row at each call."""

    def __init__(self, linear: nn.Linear, out_dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        weight, scale = rowwise(linear.weight.detach())
        self.register_buffer("weight", weight)  # [out, in], row-major: its transpose is the column-major B
        self.register_buffer("weight_scale", scale.t().contiguous())  # [1, out]
        bias = linear.bias.detach().to(out_dtype) if linear.bias is not None else None
        self.register_buffer("bias", bias)
        self.out_dtype = out_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        xq, xs = rowwise(rows)
        y = torch._scaled_mm(
            xq, self.weight.t(), scale_a=xs, scale_b=self.weight_scale, bias=self.bias, out_dtype=self.out_dtype
        )
        return y.reshape(*x.shape[:-1], y.shape[-1])


def to_fp8(model: nn.Module, exclude: list[str] | None = None) -> dict[str, Any]:
    """Swap every eligible ``nn.Linear`` of ``model`` (in place) for an :class:`Fp8Linear`; returns what was swapped
    and what was kept, with why, for the engine's builder settings."""
    swapped: list[str] = []
    kept: dict[str, str] = {}
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        if name in (exclude or []):
            kept[name] = "listed in build.torch.fp8_exclude"
        elif module.in_features % 16 or module.out_features % 16:
            kept[name] = f"{module.in_features}x{module.out_features}: FP8 GEMMs take multiples of 16"
        else:
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, Fp8Linear(module))
            swapped.append(name)
    return {"fp8_layers": len(swapped), "fp8_kept": kept}
