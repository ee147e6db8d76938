"""PyTorch engines compiled by Inductor from the trained model itself (opt-in: ``build.backends: [..., torch]``):
an AOTInductor package, or the exported program with Inductor's caches (the compiled flavour, below).

``torch.export`` captures the model with a dynamic batch axis, ``torch._inductor.aoti_compile_and_package``
compiles it ahead of time into one ``model.pt2`` (Triton kernels on the GPU, C++ on the CPU), and the runner
loads it with ``aoti_load_package``: no Python model code at serving time. On the GPU: FP16 weights, Inductor's
max-autotune (it benchmarks Triton, cuBLAS and convolution choices per shape) and ``channels_last`` for
convolutions, the settings under which Inductor beat cuDNN on ResNet-18 at batch 32 (issue 12). No INT8: the ONNX
engines carry the calibrated INT8 graphs.

Inputs and outputs keep the ONNX graph's signature and dtypes (the engine casts to FP16 inside), so validation,
gates, serving and the Triton Python backend treat it like any other engine.

A package is tied to the torch that built it (it links libtorch's ABI): the runner refuses another version. On the
H200 host (torch 2.11.0+cu130) ``aoti_load_package`` segfaulted on every ResNet-18 package, also in a fresh process
(issue 12, three sessions); the build therefore loads and runs the package once in a child process
(``build.torch.load_check``), so such a package is reported instead of killing a serving process.

Inductor's work then ships the other way (``build.torch.flavour: compiled``; what ``auto`` falls back to, and what it
builds directly for FP16 GPU engines, whose default ``gemm_epilogues`` a package cannot hold): the
exported program (``torch.export.save``) plus the caches of its compilation at the engine's batch sizes
(``torch.compiler.save_cache_artifacts``). Loading the engine runs ``torch.compile`` on the loaded program with
those caches in place (``torch.compiler.load_cache_artifacts``), so serving starts from the tuned kernels instead
of autotuning again; no C++ package loader is involved. On the GPU its calls replay CUDA graphs captured per batch
size (:class:`GraphReplays`, ``build.torch.cuda_graphs``): at batch 1 a ResNet-18 is a few dozen small kernels whose
launches, not their work, set the latency. Graphs are static per batch size (as ``torch.compile``
baselines are timed); a batch size not compiled at build time compiles on its first call, and servers pad batches
to a few sizes (``Runner.per_shape_sessions``). ``build.torch.gemm_epilogues`` rewrites the loaded program's linear
layers into cuBLASLt GEMMs with fused bias / GELU epilogues before compiling
(:mod:`kiln.stages.engines.gemm_epilogues`), ``build.torch.conv_epilogues`` its convolutions into cuDNN calls with
BatchNorm folded in and bias, residual add and ReLU fused (:mod:`kiln.stages.engines.conv_epilogues`).
"""

from __future__ import annotations

import difflib
import logging
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kiln.core.cuda_graphs import capture
from kiln.core.data import by_keyword
from kiln.core.errors import BuildError, ConfigError
from kiln.core.inputs import largest_sizes, random_inputs
from kiln.core.outputs import flatten_outputs
from kiln.core.records import EngineMetadata
from kiln.core.text import first_line
from kiln.stages.engines import conv_epilogues
from kiln.stages.engines.backend import Backend, BuildRequest, Plan
from kiln.stages.engines.config import BuildConfig, TorchConfig
from kiln.stages.engines.engines import Runner
from kiln.stages.engines.gemm_epilogues import fuse_linear_epilogues, resolve_mode
from kiln.stages.engines.onnxruntime_runner import time_calls

log = logging.getLogger("kiln.build")
PACKAGE = "model.pt2"
PROGRAM = "program.pt2"  # the compiled flavour: torch.export.save
CACHE = "inductor-cache.bin"  # the compiled flavour: torch.compiler.save_cache_artifacts
NO_MODEL_HINT = (
    "the torch backend compiles the trained PyTorch model: build it in a workdir (`kiln run`), or use "
    "--backend onnxruntime for an ONNX file"
)
# The child that loads a fresh package: a crash there (issue 12: a segfault in _load_aoti) must not be ours.
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
    max_autotune = _on(cfg.max_autotune, device == "cuda")
    return {
        "max_autotune": max_autotune,
        "coordinate_descent": max_autotune and _on(cfg.coordinate_descent, has_conv),
        "channels_last": _on(cfg.channels_last, has_conv),
        "freezing": cfg.freezing,
        "inductor": dict(cfg.inductor),
        "gemm_epilogues": (mode := resolve_mode(cfg.gemm_epilogues, device, precision, cfg.flavour)),
        "merge_linears": cfg.merge_linears and mode != "off",
        "conv_epilogues": has_conv and conv_epilogues.resolve(cfg.conv_epilogues, device, precision, cfg.flavour),
    }


def _served(model: Any, names: list[str], precision: str, channels_last: bool) -> Any:
    """The model as the engine runs it: inputs as the ONNX graph declares them (FP32, in its order), cast to the
    engine's precision and memory format inside, and passed as the export passed them (by name for a dict's keys or
    the forward's parameters); outputs flattened as the ONNX export flattened them (a tuple, dict or
    ``ModelOutput`` to its tensors, :func:`kiln.core.outputs.flatten_outputs`), back in FP32."""
    import torch

    dtype = torch.float16 if precision == "fp16" else torch.float32
    keywords = by_keyword(model, names)

    class Served(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
            xs = tuple(x.to(dtype) if x.is_floating_point() else x for x in xs)
            if channels_last:
                xs = tuple(x.contiguous(memory_format=torch.channels_last) if x.dim() == 4 else x for x in xs)
            out = self.model(**dict(zip(names, xs))) if keywords else self.model(*xs)
            return tuple(o.float() if o.is_floating_point() else o for o in flatten_outputs(out).values())

    return Served()


AXIS_HINT = "name every dynamic axis besides the batch in export.dynamic_axes (the torch backend exports with them)"


def _example_sizes(req: BuildRequest) -> dict[str, dict[int, int]] | None:
    """The sizes the export's example inputs take on the dynamic axes besides the batch: each axis its largest in the
    data (:func:`kiln.core.inputs.largest_sizes`, as the ONNX Runtime build's); None without such axes."""
    return largest_sizes(req.inputs, req.axis_sizes)


def _dynamic_shapes(req: BuildRequest) -> tuple[tuple[dict[int, Any], ...]]:
    """torch.export's ``dynamic_shapes`` for ``forward(*xs)``: the batch axis (1..max batch; the example is batch 2
    because torch.export specializes sizes 0 and 1) and every named axis of ``export.dynamic_axes`` over the sizes
    it takes (``req.axis_sizes``), one ``Dim`` per name, so inputs sharing an axis (ids and mask) stay equal."""
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
            if i > 0 and d not in dims:
                raise BuildError(f"input '{spec.name}' has a dynamic axis {d!r} without known sizes", hint=AXIS_HINT)
            axes[i] = dims["batch"] if i == 0 else dims[d]
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
        req.config.torch, req.device, req.precision, any(isinstance(m, torch.nn.Conv2d) for m in model.modules())
    )
    check_inductor_keys(settings["inductor"])
    model = model.to(req.device, dtype=torch.float16 if req.precision == "fp16" else torch.float32)
    # (epilogues with flavour aotinductor: refused by TorchConfig itself; their custom ops need the compiled one)
    package_first = (
        req.config.torch.flavour != "compiled"
        and settings["gemm_epilogues"] == "off"
        and not settings["conv_epilogues"]
    )
    # Frozen into an AOTInductor package, channels_last weights gave wrong outputs on the CPU (torch 2.13: errors of
    # 0.02-0.03 on the zoo CNN, whose first convolution has one input channel and so degenerate channels_last
    # strides; ResNet-18's were right): there the frozen weights keep their layout and Inductor picks the constants'
    # own. The compiled flavour was right either way. The inputs are channels_last in every case.
    settings["channels_last_weights"] = settings["channels_last"] and not (settings["freezing"] and package_first)
    if settings["channels_last_weights"]:
        model = model.to(memory_format=torch.channels_last)
    served = _served(model, [i.name for i in req.inputs], req.precision, settings["channels_last"]).eval()
    feed = random_inputs(req.inputs, batch=2, dynamic=_example_sizes(req), hint=AXIS_HINT)
    args = tuple(torch.from_numpy(feed[s.name]).to(req.device) for s in req.inputs)
    try:
        exported = _export(served, args, _dynamic_shapes(req), [i.name for i in req.inputs])
    except BuildError:
        raise
    except Exception as exc:  # torch.export failures: this model cannot become this engine kind
        raise BuildError(
            f"torch.export could not capture the model: {type(exc).__name__}: {first_line(exc, 300)}",
            hint="the ONNX engines still build; see torch.export's docs for unsupported code",
        ) from None
    common = {
        **settings,
        "dtype": "float16" if req.precision == "fp16" else "float32",
        "dynamic_batch": [1, max(req.max_batch, 2)],
    }
    flavour = req.config.torch.flavour
    if not package_first:
        return _build_compiled(req, exported, common, why=None)
    try:
        return _build_package(req, exported, args, common)
    except BuildError as exc:
        if flavour == "aotinductor":
            raise
        log.warning("engine %s: %s; building the compiled flavour instead (build.torch.flavour)", req.name, exc.message)
        return _build_compiled(req, exported, common, why=exc.message)


def _export(served: Any, args: tuple[Any, ...], dynamic: Any, names: list[str]) -> Any:
    """``torch.export`` with the engine's dynamic axes. A model that takes only some sizes (a U-Net's height must be
    a multiple of 4, for its pooling and upsampling to meet) fails with torch's suggested fixes; they are applied
    once (``refine_dynamic_shapes_from_suggested_fixes``, torch's own helper), unless one fixes an axis to a single
    size, which would make an engine that takes one shape only."""
    import torch
    from torch.export.dynamic_shapes import refine_dynamic_shapes_from_suggested_fixes

    with torch.inference_mode():
        try:
            return torch.export.export(served, args, dynamic_shapes=dynamic)
        except torch._dynamo.exc.UserError as exc:
            if "Suggested fixes" not in str(exc):
                raise
            refined = refine_dynamic_shapes_from_suggested_fixes(exc.msg, dynamic)
            fixed = [
                f"input '{names[i]}' axis {a}"
                for i, axes in enumerate(refined[0])
                for a, d in (axes or {}).items()
                if isinstance(d, int)
            ]  # refined[0]: forward(*xs)'s per input
            if fixed:
                raise BuildError(
                    f"torch.export: the model takes one size only on {', '.join(fixed)}",
                    hint="leave those axes out of export.dynamic_axes, or build ONNX engines only",
                ) from None
            log.info("torch.export: dynamic axes refined as torch suggests (%s)", first_line(exc, 200))
            return torch.export.export(served, args, dynamic_shapes=refined)


def _build_package(req: BuildRequest, exported: Any, args: tuple[Any, ...], common: dict[str, Any]) -> dict[str, Any]:
    """One AOTInductor package, loaded once in a child process before it is accepted."""
    import torch

    t0 = time.perf_counter()
    try:
        with torch.no_grad():  # Inductor freezes only graphs compiled without autograd (as torch._export.aot_compile)
            torch._inductor.aoti_compile_and_package(
                exported, package_path=str(req.out / PACKAGE), inductor_configs=_inductor_options(common)
            )
    except Exception as exc:  # Inductor failures: this model cannot become this engine kind
        raise BuildError(
            f"AOTInductor could not compile the model: {type(exc).__name__}: {first_line(exc, 300)}",
            hint="the ONNX engines still build; see torch.export's docs for unsupported code",
        ) from None
    compile_s = round(time.perf_counter() - t0, 2)
    if req.config.torch.load_check:
        _load_check(req.out / PACKAGE, args, req.device, req.config.torch.load_check_timeout_s)
    return {
        "files": {"model": PACKAGE},
        "flavour": "aotinductor",
        "versions": {"torch": torch.__version__},
        "builder_settings": {**common, "compile_seconds": compile_s},
    }


def warm_batches(max_batch: int) -> list[int]:
    """The batch sizes the compiled flavour compiles at build time: 1 and the largest (validation's usual pair)."""
    return sorted({1, max(max_batch, 1)})


def _build_compiled(req: BuildRequest, exported: Any, common: dict[str, Any], why: str | None) -> dict[str, Any]:
    """The exported program, and the caches of compiling it (torch.compile) at :func:`warm_batches`."""
    import torch

    (req.out / PACKAGE).unlink(missing_ok=True)  # a package that failed its load check is not part of the engine
    torch.export.save(exported, str(req.out / PROGRAM))
    cuda_graphs = req.device == "cuda" and _on(req.config.torch.cuda_graphs, True)  # this flavour's alone
    t0 = time.perf_counter()
    try:
        rewrites = _compile_and_warm(req, common, cuda_graphs)
    except Exception as exc:  # Dynamo/Inductor failures, or a fused convolution cuDNN does not run
        if not (common.get("conv_epilogues") and req.config.torch.conv_epilogues == "auto"):
            raise _compile_failed(exc) from None
        # auto turned them on for this engine kind, not for this model: the engine is still worth having without
        why_not = f"{type(exc).__name__}: {first_line(exc, 300)}"
        log.warning(
            "engine %s: with build.torch.conv_epilogues the model did not compile or run (%s); building it "
            "without them",
            req.name,
            why_not,
        )
        common = {**common, "conv_epilogues": False, "conv_epilogues_failed": why_not}
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
    return BuildError(
        f"torch.compile could not compile the exported model: {type(exc).__name__}: {first_line(exc, 300)}",
        hint="the ONNX engines still build",
    )


def _compile_and_warm(req: BuildRequest, settings: dict[str, Any], cuda_graphs: bool) -> dict[str, dict[str, int]]:
    """Compile the saved program under ``settings`` and run it once at each of :func:`warm_batches` (what fills the
    caches the engine ships); returns what its rewrites took (:func:`_compile_program`)."""
    import torch

    cfg = req.config.torch  # explicit settings warn when nothing is rewritten (auto applies to every model)
    explicit = {"gemm": cfg.gemm_epilogues != "auto", "conv": cfg.conv_epilogues != "auto"}
    run, rewrites = _compile_program(req.out / PROGRAM, settings, cuda_graphs, warn_if_nothing_fused=explicit)
    sizes = _example_sizes(req)
    with torch.inference_mode():
        for batch in warm_batches(req.max_batch):
            feed = random_inputs(req.inputs, batch=batch, dynamic=sizes, hint=AXIS_HINT)
            _run_compiled(run, [torch.from_numpy(feed[s.name]).to(req.device) for s in req.inputs])
    return rewrites


def _inductor_options(settings: dict[str, Any]) -> dict[str, Any]:
    """Inductor's config for the engine's builder settings: max-autotune as torch.compile's mode
    ``max-autotune-no-cudagraphs`` sets it (CUDA graphs are Kiln's own, :class:`GraphReplays`), with or without
    coordinate-descent tuning, freezing, and the user's ``build.torch.inductor`` entries last. Settings recorded by
    an older Kiln lack the last three: the mode's coordinate descent, off and none, as they were built."""
    import torch._inductor

    options = (
        dict(torch._inductor.list_mode_options("max-autotune-no-cudagraphs")) if settings.get("max_autotune") else {}
    )
    if options and "coordinate_descent" in settings:
        options["coordinate_descent_tuning"] = bool(settings["coordinate_descent"])
    return {**options, "freezing": bool(settings.get("freezing")), **settings.get("inductor", {})}


# Inductor entries Kiln sets from its own settings: the recorded settings must say what the engine was built with
OWNED_KEYS = {
    "freezing": "use build.torch.freezing",
    "max_autotune": "use build.torch.max_autotune",
    "coordinate_descent_tuning": "use build.torch.coordinate_descent",
    "triton.cudagraphs": "use build.torch.cuda_graphs (Kiln captures its own CUDA graphs)",
}


def check_inductor_keys(entries: dict[str, Any]) -> None:
    """``build.torch.inductor`` names real ``torch._inductor.config`` entries (dotted for nested ones), checked at
    build time because importing Inductor to validate the config file would make every Kiln command slow."""
    import torch._inductor.config

    owned = sorted(k for k in entries if k in OWNED_KEYS)
    if owned:
        raise ConfigError(
            f"build.torch.inductor: {', '.join(owned)} is set by Kiln's own settings",
            hint=", ".join(OWNED_KEYS[k] for k in owned),
        )
    known = torch._inductor.config.get_config_copy()
    unknown = sorted(k for k in entries if k not in known)
    if unknown:
        close = {k: difflib.get_close_matches(k, list(known), n=1) for k in unknown}
        guesses = ", ".join(f"{k} (did you mean {c[0]}?)" if c else k for k, c in close.items())
        raise ConfigError(
            f"build.torch.inductor: not a torch._inductor.config entry: {guesses}",
            hint="use the names of torch/_inductor/config.py, nested ones dotted (triton.cudagraphs)",
        )
    for key, value in entries.items():  # a wrong type would only fail inside torch.compile, wrapped in a BuildError
        default = known[key]
        if (
            default is not None
            and not isinstance(value, type(default))
            and not (isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool))
        ):
            raise ConfigError(
                f"build.torch.inductor: {key} takes a {type(default).__name__} (its default is "
                f"{default!r}), not {value!r}",
                hint=f"set {key} to a {type(default).__name__}",
            )


def _compile_program(
    path: Path,
    settings: dict[str, Any],
    cuda_graphs: bool = False,
    warn_if_nothing_fused: dict[str, bool] | None = None,
) -> tuple[Any, dict[str, dict[str, int]]]:
    """``torch.compile`` of a saved exported program: static shapes (one graph per batch size, as a torch.compile
    baseline is timed), compiled under the Inductor config of the build's settings (:func:`_inductor_options`), and
    on the GPU replayed as CUDA graphs of Kiln's (:class:`GraphReplays`). Freezing takes effect because every call
    runs under ``torch.inference_mode`` (Inductor freezes only graphs without autograd). With ``gemm_epilogues`` the
    linear layers are rewritten first (:mod:`kiln.stages.engines.gemm_epilogues`), with ``conv_epilogues`` the
    convolutions (:mod:`kiln.stages.engines.conv_epilogues`); returns the runnable and how many layers each rewrite
    took (``gemm_epilogue_layers``, ``conv_epilogue_layers``; absent where it did not run). ``warn_if_nothing_fused``:
    per rewrite (``gemm``, ``conv``), whether a program with nothing to rewrite is worth a warning."""
    import torch

    warn = warn_if_nothing_fused or {}
    module = torch.export.load(str(path)).module()
    rewrites: dict[str, dict[str, int]] = {}
    if settings.get("gemm_epilogues", "off") != "off":  # engines built before the setting existed: off
        rewrites["gemm_epilogue_layers"] = fuse_linear_epilogues(
            module,
            settings["gemm_epilogues"],
            warn_if_none=warn.get("gemm", False),
            merge=bool(settings.get("merge_linears")),
        )  # older engines: not merged
    if settings.get("conv_epilogues"):  # older engines: off
        rewrites["conv_epilogue_layers"] = conv_epilogues.fuse_conv_epilogues(module, warn.get("conv", False))
    options = _inductor_options(settings)
    compiled = _Configured(torch.compile(module, options=options, dynamic=False), options)
    return (GraphReplays(compiled) if cuda_graphs else compiled), rewrites


class _Configured:
    """A lazily compiled program whose compilations run under a given Inductor config.

    ``torch.compile(options=...)`` alone is not enough: those options never reached freezing (an H200 build with it
    compiled no frozen constants; ``test_inductor_config_reaches_the_compilation``), so the config is also set around
    the calls that compile: the first call of each input signature (shapes are static, so a new signature is what
    compiles). Later calls skip the patch, which costs about 25 us per call on the CPU; a recompile they trigger
    anyway (after ``torch.compiler.reset()``, say) still gets the settings ``options`` carries, not freezing."""

    def __init__(self, run: Any, options: dict[str, Any]) -> None:
        import torch._inductor.config

        self.run, self.options, self.config = run, options, torch._inductor.config
        self.compiled: set[tuple[Any, ...]] = set()

    def __call__(self, *args: Any) -> Any:
        key = _signature(args)
        if key in self.compiled:
            return self.run(*args)
        with self.config.patch(self.options):
            out = self.run(*args)
        self.compiled.add(key)
        return out


def _signature(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """What a static-shape compiled program keys its graphs on: each input's shape, dtype and device."""
    return tuple((tuple(a.shape), a.dtype, a.device) for a in args)


class GraphReplays:
    """Calls of a compiled program as CUDA graphs, one per input shape, captured on the shape's first call.

    Why not torch.compile's own CUDA graphs (cudagraph trees, mode ``max-autotune``): every call of those still
    runs Dynamo's guards and the trees' Python book-keeping before the replay, and CUDA events around a call count
    that host time as latency: on the H200 at ResNet-18 batch 32 the engine timed 0.867 ms against torch.compile
    channels_last's 0.784 ms with the same kernels (0.637 vs 0.631 ms of kernel time; ``benchmarks/engine_bench.py
    --profile``, ``engine_bench_h200_s6_profile_resnet18.md``). Here a call copies its inputs into the graph's input
    tensors (:meth:`copy_inputs`), replays, and copies the outputs out of the graph's memory, which the next
    replay overwrites, so a caller may keep them. The compiled program runs three times on a side stream before a
    capture (compilation, autotuning and cuDNN's algorithm search happen outside it, as torch.cuda.graphs asks)."""

    def __init__(self, run: Any) -> None:
        self.run = run
        # input signature -> (graph, its input tensors, its output tensors), or None: that shape runs without one
        self.graphs: dict[tuple[Any, ...], tuple[Any, list[Any], list[Any]] | None] = {}

    def __call__(self, *args: Any) -> Any:
        key = _signature(args)
        if key not in self.graphs:
            self.graphs[key] = self._capture(args)
        entry = self.graphs[key]
        if entry is None:
            return self.run(*args)  # the caller (_run_compiled) makes it a list
        graph, inputs, outputs = entry
        self.copy_inputs(inputs, args)
        graph.replay()
        return [o.clone() for o in outputs]

    @staticmethod
    def copy_inputs(inputs: list[Any], args: tuple[Any, ...]) -> None:
        """The call's inputs into the graph's input tensors: one ``Tensor.copy_`` each (a device-to-device memcpy
        for same-dtype contiguous tensors). The GPU waits for this host work before the replay starts, so it is
        on every call's latency; models have one or a few inputs, where single copies cost the host less than one
        multi-tensor ``torch._foreach_copy_`` (``benchmarks/replay_copy.py``)."""
        for dst, src in zip(inputs, args):
            dst.copy_(src)

    def _capture(self, args: tuple[Any, ...]) -> tuple[Any, list[Any], list[Any]] | None:
        """The shape's graph; None (with one warning) where the program cannot be captured, as torch.compile's own
        CUDA graphs skip what they cannot capture: the shape then runs the compiled program directly."""
        inputs = [a.clone() for a in args]
        try:
            graph, out = capture(lambda: self.run(*inputs), inputs[0].device, warmups=3)
        except RuntimeError as exc:
            log.warning(
                "torch engine: shape %s runs without a CUDA graph (capture failed: %s)",
                [tuple(a.shape) for a in args],
                first_line(exc, 200),
            )
            return None
        return graph, inputs, list(out) if isinstance(out, (tuple, list)) else [out]


def _run_compiled(run: Any, args: list[Any]) -> list[Any]:
    """One call of the compiled program (:func:`_compile_program`); outputs as a list."""
    out = run(*args)
    return list(out) if isinstance(out, (tuple, list)) else [out]


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
        why = (
            f"killed by {signal.Signals(-done.returncode).name}"
            if done.returncode < 0
            else (done.stderr.strip().splitlines() or ["exit " + str(done.returncode)])[-1][:300]
        )
        raise BuildError(
            f"the AOTInductor package does not load in a fresh process ({why})",
            hint="check that the torch that built it is the one importable here (one torch, not a "
            "second one staged on PYTHONPATH), and that libstdc++/CUDA libraries match",
        )


# ------------------------------------------------------------------------------------------------------ runner
class TorchRunner(Runner):
    """``aoti_load_package`` on the engine's device; numpy in and out, inputs in the engine's declared order."""

    @property
    def per_shape_sessions(self) -> bool:  # type: ignore[override]
        return self.meta.flavour == "compiled"  # static graphs: a new batch size compiles

    def _activate(self) -> None:
        import torch

        self.torch = torch
        self.device = torch.device("cuda", 0) if self.meta.device == "cuda" else torch.device("cpu")
        self.output_names = [o.name for o in self.meta.outputs]
        if self.meta.flavour == "compiled":
            if "cache" in self.meta.files:  # before compiling: the build's kernels and autotuning are found
                torch.compiler.load_cache_artifacts((self.engine_dir / self.meta.files["cache"]).read_bytes())
            settings = self.meta.builder_settings
            self.package, _ = _compile_program(
                self.engine_dir / self.meta.files["program"], settings, bool(settings.get("cuda_graphs"))
            )
            return
        from torch._inductor import aoti_load_package

        self.package = aoti_load_package(str(self.engine_dir / self.meta.files["model"]))

    def _call(self, args: list[Any]) -> list[Any]:
        with self.torch.inference_mode():
            if self.meta.flavour == "compiled":
                return _run_compiled(self.package, args)
            out = self.package(*args)
        return list(out) if isinstance(out, (tuple, list)) else [out]

    def _args(self, feed: dict[str, np.ndarray]) -> list[Any]:
        return [self.torch.from_numpy(np.ascontiguousarray(feed[n])).to(self.device) for n in self.input_names]

    def _infer(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {n: o.cpu().numpy() for n, o in zip(self.output_names, self._call(self._args(feed)))}

    def prepared(self, feed: dict[str, np.ndarray]) -> tuple[Any, bool]:
        """``(call, graph)`` as the ORT CUDA runner's: ``call()`` runs once on device-resident copies of ``feed`` and
        returns the first output on the device. For timing: on the GPU the work is queued on torch's current stream,
        which the CUDA events of :func:`time_calls` bracket, so the call does not wait for it (a wait inside would
        add the host's wake-up to every timing); ``graph``: whether it replays a CUDA graph."""
        args = self._args(feed)

        def call() -> Any:
            return self._call(args)[0]

        return call, isinstance(self.package, GraphReplays)

    def time_ms(self, feed: dict[str, np.ndarray], warmup: int, iterations: int) -> list[float]:
        """Engine time on device-resident inputs, outputs left on the device (as the ORT CUDA runner times)."""
        if self.meta.device != "cuda":
            return super().time_ms(feed, warmup, iterations)
        call, _ = self.prepared(feed)
        for _ in range(max(warmup, 3)):
            call()
        return time_calls(call, iterations)

    def _deactivate(self) -> None:
        del self.package


# ------------------------------------------------------------------------------------------------ registration
def _plan(cfg: BuildConfig, precision: str) -> Plan:
    devices = [d for d in cfg.torch.devices if precision == "fp32" or (precision == "fp16" and d == "cuda")]
    skipped = [
        f"torch-{d}-{precision}: AOTInductor engines are FP32, or FP16 on the GPU"
        for d in cfg.torch.devices
        if d not in devices
    ]
    return Plan(devices, skipped)


def _can_run(meta: EngineMetadata) -> tuple[bool, str]:
    import torch

    built = meta.versions.get("torch")
    if built != torch.__version__:
        return False, (
            f"built with torch {built}, this is torch {torch.__version__} (AOTInductor packages are "
            "tied to the torch that built them)"
        )
    if meta.device == "cuda" and not torch.cuda.is_available():
        return False, "torch sees no CUDA GPU"
    return True, ""


BACKEND = Backend(
    name="torch",
    devices=("cpu", "cuda"),
    settings=lambda cfg: cfg.torch,
    plan=_plan,
    build=build_torch_engine,
    runners={"cpu": TorchRunner, "cuda": TorchRunner},
    can_run=_can_run,
    triton=None,
    # opt-in and model-dependent (torch.export cannot capture every model): a failure skips it, reported
    optional=lambda cfg: True,
    rank=20,
)
