"""Low-precision linear layers for the torch engine on the GPU: FP8 (E4M3, ``torch._scaled_mm``) and INT8
(``torch._int_mm``) GEMMs, which Inductor compiles into the engine's program around the rest of the model (float16).

Three ways to scale (``build.torch.lowbit_scaling``):

- ``static``: one scale per weight and one per layer input, the latter from the largest magnitude the layer saw
  on calibration data (ModelOpt's and TensorRT's FP8 recipe): quantizing an input is then a multiply and a cast that
  Inductor fuses into the kernel producing it, the cheapest form at run time;
- ``tensorwise``: one scale per weight and per input tensor, the input's found at each call (a reduction over it);
- ``rowwise``: one scale per weight row and per input row, found at each call (torchao's dynamic recipes): the most
  precise where rows differ in range, and the GEMM kernels' slower form.

torchao is not a dependency here, so the layers are these few lines around PyTorch's own kernels. A layer stays in
the engine's higher precision where the kernel cannot take it, said per layer: widths that are not multiples of 16
(both kernels), 16 rows or fewer per sample (``torch._int_mm`` on CUDA needs more than 16 rows: a classifier head at
batch 1), a layer no calibration or example input reached, or a name in ``build.torch.lowbit_exclude``.

Layers that read the same tensor (an attention layer's Q, K and V projections) run as one GEMM over their weights
concatenated (``build.torch.merge_linears``, :class:`MergedLowbit`), as the FP16 engine's do: one wide GEMM fills a
large GPU better than three narrow ones, and at batch 1, where a GEMM's time is mostly its launch, it is one launch
instead of three (``benchmarks/lowbit_gemm_probe.py`` times both forms). The model's code still calls each layer;
the first call with an input runs the merged GEMM and each layer takes its columns of it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
INT8_MAX = 127.0  # symmetric: -127..127
MIN_CAPABILITY = {"fp8": (8, 9), "int8": (8, 0)}  # FP8 tensor cores: Ada, Hopper on; INT8 GEMMs: Ampere on
KERNEL = {"fp8": "torch._scaled_mm", "int8": "torch._int_mm"}
INT_MM_MIN_ROWS = 17
LOWBIT = tuple(MIN_CAPABILITY)


def supported(precision: str) -> str | None:
    """None where this machine's GPU runs ``precision``'s GEMMs on tensor cores; else why not (a skip line)."""
    if not torch.cuda.is_available():
        return f"{precision.upper()} engines need a CUDA GPU; torch sees none"
    capability = torch.cuda.get_device_capability()
    need = MIN_CAPABILITY[precision]
    if capability < need:
        name = torch.cuda.get_device_name()
        return (
            f"{name} (compute capability {capability[0]}.{capability[1]}) has no {precision.upper()} tensor-core "
            f"GEMMs ({need[0]}.{need[1]}+)"
        )
    return None


SCALINGS = ("static", "tensorwise", "rowwise")


def top(precision: str) -> float:
    return E4M3_MAX if precision == "fp8" else INT8_MAX


def quantize(t: torch.Tensor, precision: str, per_row: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` [rows, k] in ``precision`` with a float32 scale per row ([rows, 1]) or one for the whole tensor
    (``per_row`` False: a 0-d scale): ``t ~ q * scale``."""
    amax = t.abs().amax(dim=1, keepdim=True) if per_row else t.abs().amax()
    scale = amax.float().clamp(min=1e-12) / top(precision)
    return cast(t.float() / scale, precision), scale


def cast(scaled: torch.Tensor, precision: str) -> torch.Tensor:
    """Values already divided by their scale, saturated to the format's range and cast to it."""
    limit = top(precision)
    if precision == "fp8":
        return scaled.clamp(-limit, limit).to(torch.float8_e4m3fn)
    return scaled.round().clamp(-limit, limit).to(torch.int8)


class LowbitLinear(nn.Module):
    """``nn.Linear`` as an FP8 or INT8 GEMM, scaled as ``scaling`` says (module docstring); ``input_amax``: the
    largest input magnitude seen on calibration data (``static`` only). FP8 GEMMs accumulate in the kernels' fast
    mode (``use_fast_accum``), as FP8 inference recipes run them."""

    def __init__(
        self,
        linear: nn.Linear,
        precision: str,
        out_dtype: torch.dtype,
        scaling: str = "rowwise",
        input_amax: float | None = None,
    ) -> None:
        super().__init__()
        self.per_row = scaling == "rowwise"
        weight, scale = quantize(linear.weight.detach(), precision, self.per_row)
        # [out, in] row-major: its transpose is the column-major B both kernels take
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", scale.t().contiguous() if self.per_row else scale)  # [1, out] or 0-d
        bias = linear.bias.detach().to(out_dtype) if linear.bias is not None else None
        self.register_buffer("bias", bias)
        self.static = scaling == "static"
        if self.static:
            if input_amax is None:
                raise ValueError("static scaling needs the input's largest magnitude on calibration data")
            amax = torch.tensor(max(input_amax, 1e-12) / top(precision), device=weight.device)
            self.register_buffer("input_scale", amax.float())
            self.register_buffer("input_inv_scale", 1.0 / amax.float())  # a multiply in the quantizing kernel
        self.precision, self.out_dtype = precision, out_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if self.static:
            xq, xs = cast(rows.float() * self.input_inv_scale, self.precision), self.input_scale
        else:
            xq, xs = quantize(rows, self.precision, self.per_row)
        if self.precision == "fp8":
            y = torch._scaled_mm(
                xq,
                self.weight.t(),
                scale_a=xs,
                scale_b=self.weight_scale,
                bias=self.bias,
                out_dtype=self.out_dtype,
                use_fast_accum=True,
            )
        else:  # int32 accumulators, rescaled in the epilogue Inductor fuses after the GEMM
            y = (torch._int_mm(xq, self.weight.t()).float() * xs * self.weight_scale).to(self.out_dtype)
            if self.bias is not None:
                y = y + self.bias
        return y.reshape(*x.shape[:-1], y.shape[-1])


class MergedLowbit(nn.Module):
    """One :class:`LowbitLinear` over ``linears``' weights concatenated (their outputs side by side), quantized with
    one scale per tensor (``static``, ``tensorwise``: from the group's largest weight, so a member with smaller
    weights gets coarser steps than alone; the build's accuracy check judges the result) or per row (``rowwise``:
    as each alone). It runs once per input: the first member called with a tensor computes the whole output; the
    others take their columns of it, and once every member has, nothing of it is held (no activation kept between
    calls)."""

    def __init__(
        self,
        linears: list[nn.Linear],
        precision: str,
        out_dtype: torch.dtype,
        scaling: str,
        input_amax: float | None,
    ) -> None:
        super().__init__()
        first = linears[0]
        joined = nn.Linear(
            first.in_features,
            sum(m.out_features for m in linears),
            bias=first.bias is not None,
            device=first.weight.device,
            dtype=first.weight.dtype,
        )
        with torch.no_grad():
            joined.weight.copy_(torch.cat([m.weight for m in linears]))
            if first.bias is not None:
                joined.bias.copy_(torch.cat([m.bias for m in linears]))
        self.gemm = LowbitLinear(joined, precision, out_dtype, scaling, input_amax)
        self.members = len(linears)
        self._input: torch.Tensor | None = None
        self._output: torch.Tensor | None = None
        self._taken = 0

    def output(self, x: torch.Tensor) -> torch.Tensor:
        """The merged GEMM's output for ``x``: computed at the first member's call with ``x``, then handed on."""
        if self._input is not x:
            self._input, self._output, self._taken = x, self.gemm(x), 0
        out = self._output
        self._taken += 1
        if self._taken == self.members:  # every member took its part
            self._input = self._output = None
        return out


class LowbitSlice(nn.Module):
    """A layer merged into a :class:`MergedLowbit`: its output is columns ``start:stop`` of the merged one's (a
    view, no copy)."""

    def __init__(self, merged: MergedLowbit, start: int, stop: int) -> None:
        super().__init__()
        self.merged, self.start, self.stop = merged, start, stop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.merged.output(x)[..., self.start : self.stop]


def parallel_groups(model: nn.Module, call: Callable[[], Any]) -> list[list[str]]:
    """``nn.Linear`` layers of ``model`` that read the same tensor object, and only it, at every call during one
    ``call()`` (Q, K and V read the attention's input; a layer shared across depth, as ALBERT's, reads a new one
    each time and still groups with its siblings), with the same input width, dtype, device and bias or none: the
    layers :class:`MergedLowbit` may merge, in the model's order. The inputs are held until the end of the call, so
    no two of them share an identity."""
    inputs: dict[str, list[torch.Tensor]] = {}

    def seen(name: str) -> Any:
        def hook(_module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            inputs.setdefault(name, []).append(args[0])

        return hook

    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    hooks = [m.register_forward_pre_hook(seen(name)) for name, m in linears.items()]
    try:
        with torch.inference_mode():
            call()
    finally:
        for h in hooks:
            h.remove()
    groups: dict[tuple[Any, ...], list[str]] = {}
    for name, xs in inputs.items():
        m = linears[name]
        key = (tuple(id(x) for x in xs), m.in_features, m.weight.dtype, m.weight.device, m.bias is None)
        groups.setdefault(key, []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def observe(model: nn.Module, calls: list[Any], batch: int) -> dict[str, tuple[int, float]]:
    """Per ``nn.Linear`` of ``model``: the rows it multiplies per sample (its input's leading dims / ``batch``, on
    the first call) and the largest input magnitude over all ``calls`` (each runs the served model once: the export's
    example, whose batch is ``batch``, then any calibration batches)."""
    rows: dict[str, int] = {}
    amax: dict[str, float] = {}

    def seen(name: str) -> Any:
        def hook(_module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:  # None: the inputs stay as they are
            x = args[0]
            rows.setdefault(name, max(x.numel() // x.shape[-1] // batch, 1))
            amax[name] = max(amax.get(name, 0.0), float(x.detach().abs().max()))

        return hook

    hooks = [m.register_forward_pre_hook(seen(name)) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    try:
        with torch.inference_mode():
            for call in calls:
                call()
    finally:
        for h in hooks:
            h.remove()
    return {name: (rows[name], amax[name]) for name in rows}


def to_lowbit(
    model: nn.Module,
    precision: str,
    out_dtype: torch.dtype,
    seen: dict[str, tuple[int, float]],
    exclude: list[str] | dict[str, str] | None = None,
    scaling: str = "rowwise",
    groups: list[list[str]] | None = None,
) -> dict[str, Any]:
    """Swap every eligible ``nn.Linear`` of ``model`` (in place) for a :class:`LowbitLinear`. ``seen``: each layer's
    rows per sample and largest input (:func:`observe`; a layer no input reached is kept); ``exclude``: layers kept
    in the higher precision, by name (the user's list) or with why (the build's fallback); ``groups``: layers that
    read the same tensor (:func:`parallel_groups`), whose swapped members become one :class:`MergedLowbit` GEMM.
    Returns, for the engine's builder settings, how many layers were swapped (and merged), the ones kept with why,
    and the share of the linear layers' FLOPs per sample the swapped ones compute (what the engine's precision audit
    counts)."""
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    swapped: list[str] = []
    kept: dict[str, str] = {}
    flops = {"lowbit": 0, "all": 0}
    for name, module in linears.items():
        rows, _ = seen.get(name, (0, 0.0))
        work = 2 * rows * module.in_features * module.out_features
        flops["all"] += work
        if why := _kept(name, module, rows, precision, exclude or []):
            kept[name] = why
            continue
        swapped.append(name)
        flops["lowbit"] += work
    merged = set[str]()
    gemms = 0
    for group in groups or []:
        members = [name for name in group if name in swapped]
        if len(members) < 2:
            continue
        amax = max(seen[name][1] for name in members)
        gemm = MergedLowbit([linears[n] for n in members], precision, out_dtype, scaling, amax)
        start = 0
        for name in members:
            stop = start + linears[name].out_features
            _put(model, name, LowbitSlice(gemm, start, stop))
            start = stop
        merged.update(members)
        gemms += 1
    for name in swapped:
        if name not in merged:
            _put(model, name, LowbitLinear(linears[name], precision, out_dtype, scaling, seen[name][1]))
    share = round(flops["lowbit"] / flops["all"], 4) if flops["all"] else 0.0
    done = {
        "lowbit_kernel": KERNEL[precision],
        "lowbit_scaling": scaling,
        "lowbit_layers": len(swapped),
        "lowbit_kept": kept,
        "lowbit_linear_share": share,
    }
    if merged:
        done["lowbit_merged"] = {"layers": len(merged), "gemms": gemms}
    return done


def _put(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def _kept(name: str, module: nn.Linear, rows: int, precision: str, exclude: list[str] | dict[str, str]) -> str | None:
    """Why ``module`` stays in the engine's higher precision; None where it becomes a low-precision GEMM."""
    if name in exclude:
        return exclude[name] if isinstance(exclude, dict) else "listed in build.torch.lowbit_exclude"
    if not rows:
        return "not run by the example input"
    if module.in_features % 16 or module.out_features % 16:
        return f"{module.in_features}x{module.out_features}: {KERNEL[precision]} takes multiples of 16"
    if precision == "int8" and rows < INT_MM_MIN_ROWS:
        return f"{rows} row(s) per sample: torch._int_mm takes more than 16"
    return None


Swap = Callable[..., dict[str, Any]]  # to_lowbit with the model's precision, dtype and observations bound
Outputs = Callable[[nn.Module], list[torch.Tensor]]  # the served model's outputs with this module in it


def fit(
    model: nn.Module,
    outputs: Outputs,
    swap: Swap,
    scalings: list[str],
    exclude: dict[str, str],
    min_cosine: float,
    max_rounds: int = 4,
) -> tuple[str, dict[str, str], dict[str, Any]]:
    """The scaling and the layers kept in the higher precision for which the low-precision model's outputs keep
    ``min_cosine`` to ``model``'s (on whatever input ``outputs`` runs): the first of ``scalings`` that does (else
    the last), then, while the outputs still miss it, rounds that keep the layers with the largest own error (their
    output against the float GEMM of the same input: :func:`own_errors`) out of it, an eighth of the swapped
    layers a round, as the precision stage's fallback keeps the worst nodes of a Q/DQ graph in float. ``model`` is
    left as it is (trials run on copies). Returns (scaling, kept layers with why, what was measured)."""
    want = _flat(outputs(model))
    record: dict[str, Any] = {}
    for mode in scalings:
        trial = copy.deepcopy(model)
        swap(trial, exclude=exclude, scaling=mode)
        cosine = _cosine(_flat(outputs(trial)), want)
        record[f"{mode}_cosine"] = round(cosine, 6)
        if cosine >= min_cosine or mode == scalings[-1]:
            break
    kept, rounds = dict(exclude), []
    while cosine < min_cosine and len(rounds) < max_rounds:
        errors = own_errors(trial, model, lambda t=trial: outputs(t))
        worst = sorted(errors, key=errors.__getitem__, reverse=True)[: max(1, len(errors) // 8)]
        if not worst:
            break
        for name in worst:
            kept[name] = f"fallback round {len(rounds) + 1}: its own output error {errors[name]:.4f} (relative L2)"
        trial = copy.deepcopy(model)
        swap(trial, exclude=kept, scaling=mode)
        cosine = _cosine(_flat(outputs(trial)), want)
        rounds.append({"kept": worst, "cosine": round(cosine, 6)})
    if rounds:
        record["fallback"] = rounds
    return mode, kept, record


def own_errors(lowbit: nn.Module, model: nn.Module, run: Callable[[], Any]) -> dict[str, float]:
    """Per :class:`LowbitLinear` (or :class:`LowbitSlice`) of ``lowbit``: the relative L2 error of its output
    against ``model``'s float layer of the same name on the same input, over one call of ``run()``: its own
    quantization error, not what earlier layers passed on to it."""
    floats = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    errors: dict[str, float] = {}

    def measure(name: str) -> Any:
        def hook(_module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            ref = floats[name](args[0].to(floats[name].weight.dtype)).float()
            err = float((out.float() - ref).norm() / ref.norm().clamp(min=1e-12))
            errors[name] = max(errors.get(name, 0.0), err)

        return hook

    hooks = [
        m.register_forward_hook(measure(name))
        for name, m in lowbit.named_modules()
        if isinstance(m, (LowbitLinear, LowbitSlice)) and name in floats
    ]
    try:
        with torch.inference_mode():
            run()
    finally:
        for h in hooks:
            h.remove()
    return errors


def _flat(outputs: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([o.detach().flatten().float() for o in outputs])


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))
