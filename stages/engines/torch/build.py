"""Building torch engines: the trained model captured by ``torch.export``, then an AOTInductor package or the
exported program with Inductor's caches (the compiled flavour).

The package (``torch._inductor.aoti_compile_and_package``) is one ``model.pt2`` the runner loads with
``aoti_load_package``: no Python model code at serving time. It is tied to the torch that built it, and a loader
that crashes would take a serving process with it, so the build loads and runs each package once in a child process
(``build.torch.load_check``) before accepting it.

The compiled flavour ships the exported program (``torch.export.save``) with the caches of compiling it at the
engine's batch sizes (``torch.compiler.save_cache_artifacts``); loading the engine compiles it again from those
caches (:mod:`.program`), so serving starts from the tuned kernels. It is what ``auto`` builds for FP16 GPU engines
(whose linear-layer and convolution rewrites, :mod:`.gemm_epilogues` and :mod:`.conv_epilogues`, a package cannot
hold) and where a package fails to compile or to load.

Inputs and outputs keep the ONNX graph's names, order and dtypes (the engine casts float32 inputs to FP16 inside;
float64 and integer inputs reach the model as they come), so validation, serving and Triton's Python backend treat it
like any other engine. FP8 and INT8 engines (GPU only) run their linear layers as low-precision GEMMs (:mod:`.lowbit`),
the rest in float16; the CPU's INT8 engines are ONNX Runtime's, from the calibrated graphs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import signal
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

from kiln.calibration.feeds import load_feeds, sample_rows
from kiln.core.data import by_keyword
from kiln.core.errors import BuildError, ConfigError
from kiln.core.inputs import largest_sizes, random_inputs
from kiln.core.outputs import flatten_outputs
from kiln.core.records import steps_text
from kiln.core.text import compiler_reason, first_line
from kiln.stages.engines.backend import BuildRequest
from kiln.stages.engines.torch import conv_epilogues, cublaslt
from kiln.stages.engines.torch.config import TorchConfig
from kiln.stages.engines.torch.gemm_epilogues import resolve_mode
from kiln.stages.engines.torch.lowbit import (
    LOWBIT,
    SCALINGS,
    fit,
    observe,
    parallel_groups,
    supported,
    to_lowbit,
)
from kiln.stages.engines.torch.program import check_inductor_keys, compile_program, inductor_options, run_compiled

log = logging.getLogger("kiln.build")
OneSize = dict[str, dict[int, int]]  # input -> {axis: the one size torch.export takes}
Steps = dict[str, dict[int, tuple[int, int]]]  # input -> {axis: (step, offset) of the sizes torch.export takes}


def _dtype(precision: str) -> Any:
    """The dtype the engine's model runs in (FP8 and INT8 engines: float16 around their low-precision GEMMs)."""
    import torch

    return {"fp16": torch.float16, "fp8": torch.float16, "int8": torch.float16}.get(precision, torch.float32)


DTYPE_NAMES = {"fp16": "float16", "fp8": "float8_e4m3fn", "int8": "int8"}  # builder_settings["dtype"]


PACKAGE = "model.pt2"
PROGRAM = "program.pt2"  # the compiled flavour: torch.export.save
CACHE = "inductor-cache.bin"  # the compiled flavour: torch.compiler.save_cache_artifacts
NO_MODEL_HINT = (
    "the torch backend compiles the trained PyTorch model: build it in a workdir (`kiln run`), or use "
    "--backend onnxruntime for an ONNX file"
)
# The child that loads a fresh package: a crash there (a segfault in the loader) must not be ours.
_LOAD_CHECK = """
import sys, torch
from torch._inductor import aoti_load_package
runner = aoti_load_package(sys.argv[1])
args = torch.load(sys.argv[2])
with torch.inference_mode():
    out = runner(*[a.to(sys.argv[3]) for a in args])
print("ok", type(out).__name__)
"""


# ------------------------------------------------------------------------------------------------------- build
def _on(value: str, auto: bool) -> bool:
    """An ``auto | on | off`` setting resolved: ``auto`` takes ``auto``."""
    return value == "on" or (value == "auto" and auto)


def _settings(cfg: TorchConfig, device: str, precision: str, has_conv: bool) -> dict[str, Any]:
    max_autotune = _on(cfg.max_autotune, device == "cuda" and precision not in LOWBIT)
    return {
        "max_autotune": max_autotune,
        "coordinate_descent": device == "cuda" and _on(cfg.coordinate_descent, max_autotune and has_conv),
        "channels_last": _on(cfg.channels_last, has_conv),
        "freezing": cfg.freezing,
        "inductor": dict(cfg.inductor),
        "gemm_epilogues": (mode := resolve_mode(cfg.gemm_epilogues, device, precision, cfg.flavour)),
        "merge_linears": cfg.merge_linears and mode != "off",
        "conv_epilogues": has_conv and conv_epilogues.resolve(cfg.conv_epilogues, device, precision, cfg.flavour),
        # FP8 layers with their GELU and the next layer's cast in one cuBLASLt call (a custom op: compiled flavour)
        "fp8_gelu_epilogues": (device, precision) == ("cuda", "fp8")
        and cfg.gemm_epilogues != "off"
        and cfg.flavour != "aotinductor",
        # attention through PyTorch's fused kernels, dispatched at run time (compiled flavour, GPU)
        "fused_attention": _attention_scope(cfg.fused_attention, device, precision),
        # cuBLASLt's algorithms chosen by timing where Kiln calls it: its GEMM ops (compiled flavour, GPU)
        "gemm_algorithms": "measured" if _measures(cfg, device, precision, mode) else "heuristic",
    }


def _attention_scope(setting: str, device: str, precision: str) -> str | bool:
    """Which attention calls ``build.torch.fused_attention`` rewrites (:mod:`.attention`): ``all`` (on), ``unmasked``
    (auto: the calls without a mask, where Inductor was seen to fall back to its FP32 math form, a ViT's; a masked
    call, BERT's, keeps Inductor's fused kernel), or none (False): off, the CPU, or an FP32 engine."""
    if device != "cuda" or precision == "fp32" or setting == "off":
        return False
    return "all" if setting == "on" else "unmasked"


def _measures(cfg: TorchConfig, device: str, precision: str, mode: str) -> bool:
    """Whether ``gemm_algorithms: measured`` has GEMMs to time in this engine kind: Kiln's own GEMM ops, which
    GPU engines of the compiled flavour run with ``gemm_epilogues`` or in FP8; said where it has none."""
    if cfg.gemm_algorithms != "measured":
        return False
    if device == "cuda" and cfg.flavour != "aotinductor" and (mode != "off" or precision == "fp8"):
        return True
    log.warning(
        "build.torch.gemm_algorithms: measured: a %s %s engine%s has no GEMM of Kiln's own to time; it runs "
        "cuBLASLt's first choices",
        device,
        precision,
        " with flavour aotinductor" if cfg.flavour == "aotinductor" else "",
    )
    return False


# torch's words for two tensors of different float dtypes meeting in one op (linear, matmul, addmm, bmm, conv, lerp,
# norms, recurrent layers, attention, index_put, scatter), on the CPU and the GPU
DTYPE_CLASH = re.compile(
    r"should be the same|same dtype|dtypes must be the same|dtypes match|does not match weight dtype"
    r"|expected scalar type|expect parameter to have scalar type|mixed dtype|dtype to be equal|expected [^.]*dtype",
    re.IGNORECASE,
)
NOT_HALF_HINT = (
    "the model fails with float16 weights for another reason than its own float32 tensors (an op without float16 "
    "kernels, such as torch.fft or torch.linalg, or a fault in forward): leave fp16 out of precision.variants for "
    "this model, or use the ONNX engines of this precision"
)


def _served(model: Any, names: list[str], precision: str, channels_last: bool, autocast: str | None = None) -> Any:
    """The model as the engine runs it: inputs as the ONNX graph declares them (in its order), float32 ones cast to
    the engine's precision and every input to its memory format inside, and passed as the export passed them (by
    name for a dict's keys or the forward's parameters); outputs flattened as the ONNX export flattened them (a
    tuple, dict or ``ModelOutput`` to its tensors, :func:`kiln.core.outputs.flatten_outputs`), 16-bit float ones
    (the engine's precision, or a bfloat16 the model makes itself) back in FP32: the runner hands NumPy arrays
    out, and NumPy has no bfloat16. Inputs of other dtypes (float64 coordinates a model centres before its own cast,
    integers, a uint8 image) reach the model unchanged: cast, they would lose what the model keeps them for.
    ``autocast``: the device type to run the model under ``torch.autocast`` on (:func:`_autocast_reason`)."""
    import torch

    dtype = _dtype(precision)
    halves = (torch.float16, torch.bfloat16)
    keywords = by_keyword(model, names)

    class Served(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
            xs = tuple(x.to(dtype) if x.dtype == torch.float32 else x for x in xs)
            if channels_last:
                xs = tuple(_in_channels_last(x) for x in xs)
            with torch.autocast(autocast, dtype=dtype) if autocast else contextlib.nullcontext():
                out = self.model(**dict(zip(names, xs))) if keywords else self.model(*xs)
            return tuple(o.float() if o.dtype in halves else o for o in flatten_outputs(out).values())

    return Served()


def _autocast_reason(model: Any, req: BuildRequest, args: tuple[Any, ...]) -> str | None:
    """Why a float16 engine's model runs under ``torch.autocast``: None where it runs with its weights in float16 on
    the example inputs (every model of a float32 engine), else the error it gave, once it runs under autocast.

    A forward that makes float32 tensors itself (a uint8 image's ``x.float() / 255``, float64 coordinates centred
    and then cast with ``.float()``) meets float16 weights and fails ("Input type (float) and bias type
    (c10::Half) should be the same"). Such a model still makes a float16 engine: under autocast the weights stay
    float16 (cast once, here, not at every call) and autocast casts the float32 tensors to float16 at each
    convolution and matrix multiply, as the plain engine computes them; its float32 ops (softmax, normalization)
    run in float32. Skipping the engine would leave every model that normalizes its own inputs without one. A model
    that fails under autocast too is a :class:`BuildError` naming both errors: the stage skips the engine, reported
    with the reason. Only a dtype clash (:data:`DTYPE_CLASH`) takes the autocast path. Another error is a
    :class:`BuildError` with the error as it came and no cast hint: an op without float16 kernels
    (``torch.fft.rfft``, ``torch.linalg.inv``) passes under autocast only because autocast runs it in float32, an
    engine that is not the float16 one it says; an ``IndexError`` is no dtype problem."""
    import torch

    if _dtype(req.precision) == torch.float32:
        return None
    names = [i.name for i in req.inputs]
    failed = _fails(_served(model, names, req.precision, False), args)
    if failed is None:
        return None
    if not DTYPE_CLASH.search(failed):  # autocast would hide it: an op without float16 kernels, or a plain bug
        raise BuildError(f"the model does not run with its weights in float16: {failed}", hint=NOT_HALF_HINT)
    again = _fails(_served(model, names, req.precision, False, autocast=req.device), args)
    if again is not None:
        raise BuildError(
            f"the model does not run with its weights in float16 ({failed}), nor under torch.autocast ({again})",
            hint="cast inside forward to the weights' dtype (x.to(self.conv.weight.dtype)), or use the ONNX engines "
            "of this precision",
        )
    log.warning("engine %s: with float16 weights the model failed (%s); it runs under torch.autocast", req.name, failed)
    return failed


def _fails(served: Any, args: tuple[Any, ...]) -> str | None:
    """The error ``served`` gives on ``args``, or None where it runs. Running out of memory is no fact about the
    model's dtypes: it propagates as it came."""
    import torch

    try:
        with torch.inference_mode():
            served(*args)
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:  # a dtype clash, or whatever this model raises: the caller tells them apart
        return f"{type(exc).__name__}: {first_line(exc, 300)}"
    return None


AXIS_HINT = "name every dynamic axis besides the batch in signature.dynamic_axes (the torch backend exports with them)"


def _example_sizes(req: BuildRequest) -> dict[str, dict[int, int]] | None:
    """The sizes the export's example inputs take on the dynamic axes besides the batch: each axis its largest in the
    data (:func:`kiln.core.inputs.largest_sizes`, as the ONNX Runtime build's); None without such axes."""
    return largest_sizes(req.inputs, req.axis_sizes)


def _example_feed(req: BuildRequest, batch: int) -> dict[str, Any]:
    """``batch`` rows the build runs the model on (capture, checks, warm-up): the precision stage's saved samples
    (``req.calibration``, :func:`kiln.calibration.feeds.sample_rows`) where they hold every input at sizes the engine
    takes, since random values can break what the model assumes of its inputs (a layout model's box width
    ``x1 - x0`` indexes a table, and random corners give a negative width); else :func:`_random_feed`."""
    names = [spec.name for spec in req.inputs]
    if req.calibration is not None and req.calibration.is_file():
        rows = sample_rows(req.calibration, names, batch)
        if rows is not None and _engine_takes(req, rows):
            return {spec.name: rows[spec.name].astype(spec.dtype, copy=False) for spec in req.inputs}
        log.info("engine %s: the saved calibration rows do not fit its inputs; it runs on random ones", req.name)
    return _random_feed(req, batch)


def _engine_takes(req: BuildRequest, feed: dict[str, Any]) -> bool:
    """Whether every array of ``feed`` has its input's rank, its fixed sizes and, on named axes, a size within
    ``req.axis_sizes``."""
    for spec in req.inputs:
        shape = feed[spec.name].shape
        if len(shape) != len(spec.shape):
            return False
        for axis, (dim, size) in enumerate(zip(spec.shape, shape)):
            if axis and isinstance(dim, int) and dim >= 1 and dim != size:
                return False
            sizes = req.axis_sizes.get(dim) if axis and isinstance(dim, str) else None
            if sizes and not min(sizes) <= size <= max(sizes):
                return False
    return True


def _random_feed(req: BuildRequest, batch: int) -> dict[str, Any]:
    """Random inputs of ``batch`` rows at :func:`_example_sizes`, each index within the table it indexes
    (``req.index_ranges``: a float timestep the model casts to an index is drawn as a whole number in range, where
    standard normal values would index row -1 and PyTorch's embedding refuses it)."""
    return random_inputs(
        req.inputs, batch=batch, dynamic=_example_sizes(req), hint=AXIS_HINT, int_ranges=req.index_ranges
    )


def _dynamic_shapes(req: BuildRequest) -> tuple[tuple[dict[int, Any], ...]]:
    """torch.export's ``dynamic_shapes`` for ``forward(*xs)``: the first axes (1..max batch; the example is batch 2
    because torch.export specializes sizes 0 and 1), one ``Dim`` per name (a two-tower model's texts and images
    apart), and every named axis of ``signature.dynamic_axes`` over the sizes it takes (``req.axis_sizes``), one
    ``Dim`` per name, so inputs sharing an axis (ids and mask) stay equal."""
    import torch

    # max 3 at least: with the example batch (2) at the range's top, torch suggests pinning the batch to 2 among
    # the fixes for other axes (a U-Net's height; see _export)
    dims = {"batch": torch.export.Dim("batch", min=1, max=max(req.max_batch, 3))}
    dims |= {
        name: torch.export.Dim(re.sub(r"\W", "_", name), min=lo, max=hi) for name, (lo, hi) in req.axis_sizes.items()
    }
    per_input = []
    for spec in req.inputs:
        axes = {}
        for i, d in enumerate(spec.shape):
            if isinstance(d, int) and d > 0:
                continue
            if i == 0:  # the batch, or a first axis of its own (a two-tower model's texts and images): by name
                first = d if isinstance(d, str) and d else "batch"
                batch = torch.export.Dim(re.sub(r"\W", "_", first), min=1, max=max(req.max_batch, 3))
                axes[i] = dims.setdefault(first, batch)
                continue
            if d not in dims:
                raise BuildError(f"input '{spec.name}' has a dynamic axis {d!r} without known sizes", hint=AXIS_HINT)
            axes[i] = dims[d]
        per_input.append(axes)
    return (tuple(per_input),)  # (*xs,): one varargs entry


def build_torch_engine(req: BuildRequest) -> dict[str, Any]:
    import torch

    if req.torch_model is None:
        raise ConfigError(
            "the torch backend needs the PyTorch model, and this build has only an ONNX file", hint=NO_MODEL_HINT
        )
    if req.device == "cuda" and not torch.cuda.is_available():
        raise BuildError(
            "torch sees no CUDA GPU: an AOTInductor CUDA package is compiled and tuned on the GPU",
            hint="build on the GPU host, or set build.torch.devices: [cpu]",
        )
    model = req.torch_model().eval()
    settings = _settings(
        req.settings, req.device, req.precision, any(isinstance(m, torch.nn.Conv2d) for m in model.modules())
    )
    check_inductor_keys(settings["inductor"])
    model = model.to(req.device, dtype=_dtype(req.precision))
    feed = _example_feed(req, 2)
    args = tuple(torch.from_numpy(feed[s.name]).to(req.device) for s in req.inputs)
    if reason := _autocast_reason(model, req, args):
        settings.update(autocast=True, autocast_reason=reason)
    if req.precision in LOWBIT:  # the linear layers as FP8/INT8 GEMMs, the rest in float16
        _lowbit_device(req)
        settings.update(_lowbit(model, req, args, req.device if settings.get("autocast") else None))
    # (epilogues with flavour aotinductor: refused by TorchConfig itself; their custom ops need the compiled one)
    package_first = req.settings.flavour == "aotinductor" or (
        req.settings.flavour == "auto"
        and settings["gemm_epilogues"] == "off"
        and not settings["conv_epilogues"]
        and req.precision not in LOWBIT  # replayed as CUDA graphs: their quantize kernels are many small launches
    )
    if package_first:  # the compiled flavour's rewrite: a package keeps Inductor's attention
        settings["fused_attention"] = False
    # Frozen into an AOTInductor package, channels_last weights gave wrong outputs on the CPU (torch 2.13, a first
    # convolution with one input channel): there the frozen weights keep their layout. The inputs are channels_last
    # in every case.
    settings["channels_last_weights"] = settings["channels_last"] and not (settings["freezing"] and package_first)
    exported, one_size, steps = _captured(model, req, args, settings)
    if one_size:  # the engine takes these axes at one size: its inputs say so, and the build warms that size only
        req = with_one_size(req, one_size)
        settings["one_size_axes"] = one_size
        log.warning("engine %s takes %s at one size only: requests of other sizes are refused", req.name, one_size)
    if steps:  # the engine takes these axes in steps (a U-Net's multiples of 4): requests between them are refused
        settings["axis_steps"] = axis_steps(req, steps)
        said = ", ".join(f"{k}{steps_text(pattern)}" for k, pattern in settings["axis_steps"].items())
        log.warning("engine %s takes %s (torch.export's constraint): other sizes are refused", req.name, said)
    common = {
        **settings,
        "dtype": DTYPE_NAMES.get(req.precision, "float32"),
        "dynamic_batch": [1, max(req.max_batch, 2)],
    }
    built = _build_flavour(req, exported, args, common, package_first)
    return {**built, "inputs": req.inputs} if one_size else built


def _lowbit_device(req: BuildRequest) -> None:
    """FP8/INT8 engines are built for GPUs whose tensor cores run those GEMMs: elsewhere a BuildError saying so."""
    why = supported(req.precision) if req.device == "cuda" else f"{req.precision.upper()} engines are built for GPUs"
    if why:
        need = "8.0+ (Ampere on)" if req.precision == "int8" else "8.9+ (Ada, Hopper)"
        raise BuildError(why, hint=f"build {req.precision.upper()} engines on a GPU with compute capability {need}")


def _lowbit(model: Any, req: BuildRequest, args: tuple[Any, ...], autocast: str | None = None) -> dict[str, Any]:
    """Swap the model's linear layers for FP8/INT8 GEMMs where this GPU and the kernel take them
    (:func:`kiln.stages.engines.torch.lowbit.to_lowbit`), scaled as ``build.torch.lowbit_scaling`` says; ``auto``
    takes the first of static (where calibration data came with the request), tensorwise and rowwise whose outputs
    keep a cosine of :data:`AUTO_MIN_COSINE` to the unquantized model's on the first calibration batch (else the
    example); while they miss it, the layers with the largest own error stay in float16
    (:func:`kiln.stages.engines.torch.lowbit.fit`). With ``build.torch.merge_linears``, layers that read the same
    tensor become one GEMM. ``autocast``: as :func:`_served`'s. Returns what was swapped, for the builder settings."""
    import torch

    served = _served(model, [i.name for i in req.inputs], req.precision, False, autocast)
    batches = _calibration(req)
    seen = observe(model, [lambda xs=xs: served(*xs) for xs in [args, *batches]], batch=len(args[0]))
    groups = parallel_groups(model, lambda: served(*args)) if req.settings.merge_linears else []
    swap = partial(to_lowbit, precision=req.precision, out_dtype=_dtype(req.precision), seen=seen, groups=groups)
    scaling = req.settings.lowbit_scaling
    if scaling == "static" and not batches:
        raise BuildError(
            "build.torch.lowbit_scaling static needs calibration data, and this build has none",
            hint="build in a workdir (`kiln run`: the precision stage saves calibration batches), or use tensorwise",
        )
    scalings = [m for m in SCALINGS if m != "static" or batches] if scaling == "auto" else [scaling]
    probe = batches[0] if batches else args

    def outputs(module: Any) -> list[Any]:  # the served model's outputs on the probe, with ``module`` in it
        served.model = module
        try:
            with torch.inference_mode():
                return list(served(*probe))
        finally:
            served.model = model

    user = dict.fromkeys(req.settings.lowbit_exclude, "listed in build.torch.lowbit_exclude")
    scaling, kept, record = fit(model, outputs, swap, scalings, user, AUTO_MIN_COSINE)
    done = swap(model, exclude=kept, scaling=scaling)
    done["lowbit_calibration_batches"] = len(batches)
    return {**done, "lowbit_scaling_check": record}


AUTO_MIN_COSINE = 0.995  # lowbit_scaling auto: the first form whose outputs keep this cosine (half FP8's gate)


def _calibration(req: BuildRequest) -> list[tuple[Any, ...]]:
    """The calibration batches that came with the request (``BuildRequest.calibration``), as the engine's inputs
    in order on its device; none without."""
    import torch

    if req.calibration is None or not req.calibration.is_file():
        return []
    names = [spec.name for spec in req.inputs]
    return [tuple(torch.from_numpy(f[n]).to(req.device) for n in names) for f in load_feeds(req.calibration, names)]


def _build_flavour(
    req: BuildRequest, exported: Any, args: tuple[Any, ...], common: dict[str, Any], package_first: bool
) -> dict[str, Any]:
    """The AOTInductor package, or the compiled flavour where it applies or the package fails."""
    if not package_first:
        return _build_compiled(req, exported, common, why=None)
    try:
        return _build_package(req, exported, args, common)
    except BuildError as exc:
        if req.settings.flavour == "aotinductor":
            raise
        log.warning("engine %s: %s; building the compiled flavour instead (build.torch.flavour)", req.name, exc.message)
        return _build_compiled(req, exported, common, why=exc.message)


def axis_steps(req: BuildRequest, steps: Steps) -> dict[str, list[int]]:
    """Axis label -> [step, offset] from torch.export's input -> {axis: (step, offset)}."""
    shapes = {spec.name: spec.shape for spec in req.inputs}
    return {str(shapes[name][a]): list(step) for name, axes in steps.items() for a, step in axes.items()}


def with_one_size(req: BuildRequest, one_size: OneSize) -> BuildRequest:
    """``req`` with the axes torch.export took at one size fixed to it in the inputs' shapes and axis sizes."""
    inputs, labels = [], {}
    for spec in req.inputs:
        shape = list(spec.shape)
        for axis, size in one_size.get(spec.name, {}).items():
            labels[str(shape[axis])] = size
            shape[axis] = size
        inputs.append(spec.model_copy(update={"shape": shape}))
    sizes = {k: v for k, v in req.axis_sizes.items() if k not in labels}
    return dataclasses.replace(req, inputs=inputs, axis_sizes=sizes)


def _captured(
    model: Any, req: BuildRequest, args: tuple[Any, ...], settings: dict[str, Any]
) -> tuple[Any, OneSize, Steps]:
    """:func:`_capture`, and where channels_last chosen by auto (a model with convolutions) breaks torch.export (it
    can on dynamic heights and widths), again in the model's own layout, recorded in ``settings``. A failure that
    remains is a BuildError naming torch.export's reason."""
    import torch

    retry = settings["channels_last"] and req.settings.channels_last == "auto"
    for attempt in (0, 1) if retry else (0,):
        try:
            return _capture(model, req, args, settings)
        except BuildError:
            raise
        except Exception as exc:  # torch.export failures: this model cannot become this engine kind (this layout?)
            reason = f"{type(exc).__name__}: {first_line(exc, 300)}"
        if attempt == 0 and retry:
            log.info(
                "engine %s: torch.export failed with channels_last (%s); capturing in its own layout", req.name, reason
            )
            settings.update(channels_last=False, channels_last_weights=False, channels_last_dropped=reason)
            model = model.to(memory_format=torch.contiguous_format)
    hint = "the ONNX engines still build; see torch.export's docs for unsupported code"
    if settings["channels_last"]:  # asked for explicitly
        hint = "try build.torch.channels_last: off (it changes the memory layout only); " + hint
    raise BuildError(f"torch.export could not capture the model: {reason}", hint=hint) from None


def _capture(
    model: Any, req: BuildRequest, args: tuple[Any, ...], settings: dict[str, Any]
) -> tuple[Any, OneSize, Steps]:
    """The served model (in channels_last where the settings say so, under autocast where they say so) through
    :func:`_export`. torch.export records autocast as a call of a submodule (``wrap_with_autocast``), which hides its
    layers from the graph rewrites (:mod:`.gemm_epilogues`, :mod:`.conv_epilogues`); ``run_decompositions({})``
    inlines it as explicit casts and keeps every other op as it is."""
    import torch

    if settings["channels_last_weights"]:
        model = _weights_in_channels_last(model)
    autocast = req.device if settings.get("autocast") else None
    names = [i.name for i in req.inputs]
    served = _served(model, names, req.precision, settings["channels_last"], autocast).eval()
    exported, one_size, steps = _export(served, args, _dynamic_shapes(req), names)
    if autocast:
        with torch.inference_mode():
            exported = exported.run_decompositions({})
    return exported, one_size, steps


def _in_channels_last(t: Any) -> Any:
    """``t`` in ``channels_last`` where it is 4-D (a Conv2d's weights and images), else as it is. A 5-D tensor (a
    Conv3d's) keeps its layout: ``channels_last`` has no 5-D form, and ``channels_last_3d`` made an AOTInductor
    package on the CPU answer a batch of one otherwise than the same rows in a larger batch (torch 2.13)."""
    import torch

    return t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t


def _weights_in_channels_last(model: Any) -> Any:
    """``model`` with its 4-D parameters and buffers in ``channels_last`` (:func:`_in_channels_last`), the others
    as they are: ``model.to(memory_format=torch.channels_last)`` refuses a Conv3d's 5-D weights. A failure here is
    the layout's, not torch.export's: a BuildError saying so."""
    try:
        return model._apply(_in_channels_last)  # what Module.to applies, to the 4-D tensors only
    except RuntimeError as exc:
        raise BuildError(
            f"the model's weights could not be put in the channels_last memory format: {first_line(exc, 300)}",
            hint="set build.torch.channels_last: off (it changes the memory layout only)",
        ) from None


def _export(served: Any, args: tuple[Any, ...], dynamic: Any, names: list[str]) -> tuple[Any, OneSize, Steps]:
    """``torch.export`` with the engine's dynamic axes: (the program, input -> {axis: size} it takes one size of,
    input -> {axis: (step, offset)} it takes in steps of).
    A model that takes only some sizes (a U-Net's height must be a multiple of 4, for its pooling and upsampling to
    meet) fails with torch's suggested fixes; they are applied once (``refine_dynamic_shapes_from_suggested_fixes``,
    torch's own helper). A fix may pin an axis to the example's size: torch.export specialises some ops to it (a
    recurrent layer's length), and the engine then takes that size only on that axis."""
    import torch
    from torch.export.dynamic_shapes import refine_dynamic_shapes_from_suggested_fixes

    with torch.inference_mode():
        try:
            return torch.export.export(served, args, dynamic_shapes=dynamic), {}, {}
        except torch._dynamo.exc.UserError as exc:
            if "Suggested fixes" not in str(exc):
                raise
            refined = refine_dynamic_shapes_from_suggested_fixes(exc.msg, dynamic)
            fixed = [
                f"input '{names[i]}' axis {a} ({d})"
                for i, axes in enumerate(refined[0])
                for a, d in (axes or {}).items()
                if isinstance(d, int)
            ]  # refined[0]: forward(*xs)'s per input
            if fixed:
                log.info("torch.export takes one size only on %s (%s)", ", ".join(fixed), first_line(exc, 200))
            else:
                log.info("torch.export: dynamic axes refined as torch suggests (%s)", first_line(exc, 200))
            one_size = {
                names[i]: {a: d for a, d in (axes or {}).items() if isinstance(d, int)}
                for i, axes in enumerate(refined[0])
            }
            steps = {
                names[i]: {a: _step(d) for a, d in (axes or {}).items() if _step(d)}
                for i, axes in enumerate(refined[0])
            }
            program = torch.export.export(served, args, dynamic_shapes=refined)
            return program, {k: v for k, v in one_size.items() if v}, {k: v for k, v in steps.items() if v}


def _step(dim: Any) -> tuple[int, int] | None:
    """(step, offset) of a size torch.export derived from another (``h = 4*_h``: sizes 4k), or None."""
    fn = getattr(dim, "fn", None)
    if fn is None or not hasattr(dim, "root"):
        return None
    step = int(fn(1)) - int(fn(0))
    return (step, int(fn(0)) % step) if step > 1 else None


def _build_package(req: BuildRequest, exported: Any, args: tuple[Any, ...], common: dict[str, Any]) -> dict[str, Any]:
    """One AOTInductor package, loaded once in a child process before it is accepted."""
    import torch

    t0 = time.perf_counter()
    try:
        with torch.no_grad():  # Inductor freezes only graphs compiled without autograd (as torch._export.aot_compile)
            torch._inductor.aoti_compile_and_package(
                exported, package_path=str(req.out / PACKAGE), inductor_configs=inductor_options(common)
            )
    except Exception as exc:  # Inductor failures: this model cannot become this engine kind
        raise BuildError(
            f"AOTInductor could not compile the model: {type(exc).__name__}: {compiler_reason(exc)}",
            hint="the ONNX engines still build; see torch.export's docs for unsupported code",
        ) from None
    compile_s = round(time.perf_counter() - t0, 2)
    if req.settings.load_check:
        _load_check(req.out / PACKAGE, args, req.device, req.settings.load_check_timeout_s)
    return {
        "files": {"model": PACKAGE},
        "flavour": "aotinductor",
        "versions": {"torch": torch.__version__},
        "builder_settings": {**common, "compile_seconds": compile_s},
    }


def warm_batches(max_batch: int) -> list[int]:
    """The batch sizes the compiled flavour compiles at build time: 1 and the largest (validation's usual pair)."""
    return sorted({1, max(max_batch, 1)})


# Rewrites of the compiled flavour that ``auto`` turns on by engine kind: a model they fail on is built without them
AUTO_REWRITES = ("conv_epilogues", "fused_attention")


def _build_compiled(req: BuildRequest, exported: Any, common: dict[str, Any], why: str | None) -> dict[str, Any]:
    """The exported program, and the caches of compiling it (torch.compile) at :func:`warm_batches`."""
    import torch

    (req.out / PACKAGE).unlink(missing_ok=True)  # a package that failed its load check is not part of the engine
    torch.export.save(exported, str(req.out / PROGRAM))
    cuda_graphs = req.device == "cuda" and _on(req.settings.cuda_graphs, True)  # this flavour's alone
    t0 = time.perf_counter()
    try:
        rewrites = _compile_and_warm(req, common, cuda_graphs)
    except Exception as exc:  # Dynamo/Inductor failures, a fused convolution cuDNN does not run, an attention call
        # auto turned these on for this engine kind, not for this model: the engine is still worth having without
        dropped = [k for k in AUTO_REWRITES if common.get(k) and getattr(req.settings, k) == "auto"]
        if not dropped:
            raise _compile_failed(exc) from None
        why_not = f"{type(exc).__name__}: {first_line(exc, 300)}"
        log.warning(
            "engine %s: with build.torch.%s the model did not compile or run (%s); building it without them",
            req.name,
            " and ".join(dropped),
            why_not,
        )
        common = {**common, **dict.fromkeys(dropped, False), **{f"{k}_failed": why_not for k in dropped}}
        try:
            rewrites = _compile_and_warm(req, common, cuda_graphs)
        except Exception as again:
            raise _compile_failed(again) from None
    artifacts = torch.compiler.save_cache_artifacts()
    files = {"program": PROGRAM}
    if artifacts is not None:
        (req.out / CACHE).write_bytes(artifacts[0])
        files["cache"] = CACHE
    settings = {
        **common,
        "cuda_graphs": cuda_graphs,
        "compile_seconds": round(time.perf_counter() - t0, 2),
        "compiled_batches": warm_batches(req.max_batch),
    }
    settings.update(rewrites)
    if why is not None:
        settings["aotinductor_failed"] = why
    return {
        "files": files,
        "flavour": "compiled",
        "versions": {"torch": torch.__version__},
        "builder_settings": settings,
    }


def _compile_failed(exc: BaseException) -> BuildError:
    """The compiled flavour's failure: a kernel's index check on the example inputs (an index out of its table) is
    no compiler failure, and its fix is the inputs (:data:`INDEX_HINT`)."""
    reason = f"{type(exc).__name__}: {compiler_reason(exc)}"
    if "index out of bounds" in reason:
        return BuildError(f"the compiled model failed on the build's example inputs ({reason})", hint=INDEX_HINT)
    return BuildError(
        f"torch.compile could not compile the exported model: {reason}", hint="the ONNX engines still build"
    )


def _compile_and_warm(req: BuildRequest, settings: dict[str, Any], cuda_graphs: bool) -> dict[str, Any]:
    """Compile the saved program under ``settings`` and run it once at each of :func:`warm_batches` (what fills the
    caches the engine ships); returns what its rewrites took (:func:`compile_program`) and, with
    ``gemm_algorithms: measured``, the cuBLASLt algorithms chosen (``gemm_algorithm_choices``, which the engine's
    loaders adopt)."""
    import torch

    cfg = req.settings  # explicit settings warn when nothing is rewritten (auto applies to every model)
    explicit = {"gemm": cfg.gemm_epilogues != "auto", "conv": cfg.conv_epilogues != "auto"}
    run, rewrites = compile_program(req.out / PROGRAM, settings, cuda_graphs, warn_if_nothing_fused=explicit)
    with torch.inference_mode():
        for batch in warm_batches(req.max_batch):
            feed = _example_feed(req, batch)
            run_compiled(run, [torch.from_numpy(feed[s.name]).to(req.device) for s in req.inputs])
    if settings.get("gemm_algorithms") == "measured":
        return {**rewrites, "gemm_algorithm_choices": cublaslt.choices()}
    return rewrites


def _load_check(package: Path, args: tuple[Any, ...], device: str, timeout: float) -> None:
    """Load and run the package once in a child process; a crash or error there is a :class:`BuildError`."""
    import torch

    with tempfile.TemporaryDirectory(prefix="kiln-aoti-") as tmp:
        sample = Path(tmp) / "args.pt"
        torch.save(tuple(a.cpu() for a in args), sample)
        try:
            done = subprocess.run(
                [sys.executable, "-c", _LOAD_CHECK, str(package), str(sample), device],
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise BuildError(
                f"loading the AOTInductor package took over {timeout:.0f}s",
                hint="raise build.torch.load_check_timeout_s",
            ) from None
    if done.returncode != 0:
        raise _load_failed(done.stderr, done.returncode)


LOADER_HINT = (
    "check that the torch that built it is the one importable here (one torch, not a second one staged on "
    "PYTHONPATH), and that libstdc++/CUDA libraries match"
)
INDEX_HINT = (
    "give data (data.name) so the build runs the model on real samples, or clamp or sort such indices in forward "
    "(a box's corners, a difference used as an index)"
)
# a C++ exception of torch's (c10::Error, or any uncaught one): its message is the line to say, not the backtrace's
CPP_ERROR = re.compile(r"what\(\):|c10::Error|index out of bounds")


def _load_failed(stderr: str, returncode: int) -> BuildError:
    """Why the load check's child failed, as a :class:`BuildError`: a C++ exception by its message
    (:func:`_cpp_error`), else the signal that killed it or its last line. A kernel's index check (an index out of
    its table) is the model failing on the example inputs, whose fix is the inputs; anything else is the loader's
    (a library the package was built against, as a ``dlopen`` error says it)."""
    what = _cpp_error(stderr) if CPP_ERROR.search(stderr) else ""
    if "out of bounds" in what or "out of range" in what:
        return BuildError(
            f"the AOTInductor package failed on the build's example inputs: an index out of range ({what})",
            hint=INDEX_HINT,
        )
    why = what or (
        f"killed by {signal.Signals(-returncode).name}"
        if returncode < 0
        else (stderr.strip().splitlines() or ["exit " + str(returncode)])[-1][:300]
    )
    return BuildError(f"the AOTInductor package does not load in a fresh process ({why})", hint=LOADER_HINT)


def _cpp_error(stderr: str) -> str:
    """The message of the C++ exception in ``stderr``: the text after ``what():`` (an uncaught exception), else the
    line above c10's ``Exception raised from`` (its message, before the backtrace), else the first line that names
    an index out of bounds."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    for i, line in enumerate(lines):
        if "what():" in line:
            return line.split("what():", 1)[1].strip()[:300]
        if line.startswith("Exception raised from") and i:
            return lines[i - 1][:300]
    return next((line[:300] for line in lines if "index out of bounds" in line and not line.startswith("frame")), "")
