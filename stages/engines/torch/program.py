"""The compiled flavour's program at run time: ``torch.compile`` of a saved exported program under the engine's
Inductor settings, replayed as Kiln's own CUDA graphs on the GPU. Shared by the build (which compiles and warms it
to save Inductor's caches) and the runner (which compiles it again from those caches)."""

from __future__ import annotations

import difflib
import logging
from pathlib import Path
from typing import Any

from kiln.core.cuda_graphs import capture
from kiln.core.errors import ConfigError
from kiln.core.text import first_line
from kiln.stages.engines.torch import conv_epilogues, cublaslt
from kiln.stages.engines.torch.attention import fuse_attention
from kiln.stages.engines.torch.fp8_epilogues import fuse_fp8_gelu, measure_fp8_gemms
from kiln.stages.engines.torch.gemm_epilogues import fuse_linear_epilogues

log = logging.getLogger("kiln.build")


def inductor_options(settings: dict[str, Any]) -> dict[str, Any]:
    """Inductor's config for the engine's builder settings: max-autotune as torch.compile's mode
    ``max-autotune-no-cudagraphs`` sets it (CUDA graphs are Kiln's own, :class:`GraphReplays`), coordinate-descent
    tuning with it or alone (an FP8 engine's quantizing kernels, built without max-autotune), freezing, and the
    user's ``build.torch.inductor`` entries last. Settings recorded by an older Kiln lack the last three: the mode's
    coordinate descent, off and none, as they were built."""
    import torch._inductor

    options = (
        dict(torch._inductor.list_mode_options("max-autotune-no-cudagraphs")) if settings.get("max_autotune") else {}
    )
    if "coordinate_descent" in settings and (options or settings["coordinate_descent"]):
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


def compile_program(
    path: Path,
    settings: dict[str, Any],
    cuda_graphs: bool = False,
    warn_if_nothing_fused: dict[str, bool] | None = None,
) -> tuple[Any, dict[str, dict[str, int]]]:
    """``torch.compile`` of a saved exported program: static shapes (one graph per batch size, as a torch.compile
    baseline is timed), compiled under the Inductor config of the build's settings (:func:`inductor_options`), and
    on the GPU replayed as CUDA graphs of Kiln's (:class:`GraphReplays`). Freezing takes effect because every call
    runs under ``torch.inference_mode`` (Inductor freezes only graphs without autograd). With ``gemm_epilogues`` the
    linear layers are rewritten first (:mod:`.gemm_epilogues`), with ``conv_epilogues`` the convolutions
    (:mod:`.conv_epilogues`), with ``fused_attention`` the FP16 attention calls (:mod:`.attention`), with
    ``fp8_gelu_epilogues`` an FP8 layer's GELU and the next layer's input cast (:mod:`.fp8_epilogues`), with
    ``gemm_algorithms: measured`` an FP8 engine's other layers too (:func:`.fp8_epilogues.measure_fp8_gemms`);
    returns the runnable and how many layers each rewrite took (``gemm_epilogue_layers``, ``conv_epilogue_layers``,
    ``fused_attention_layers``, ``fp8_epilogue_layers``, ``measured_fp8_layers``; absent where it did not run).
    ``warn_if_nothing_fused``: per rewrite (``gemm``, ``conv``), whether a program with nothing to rewrite is worth
    a warning."""
    import torch

    warn = warn_if_nothing_fused or {}
    module = torch.export.load(str(path)).module()
    rewrites: dict[str, dict[str, int]] = {}
    measure = settings.get("gemm_algorithms") == "measured"  # older engines: heuristic
    if measure and settings.get("gemm_algorithm_choices"):  # a built engine: what its build chose
        cublaslt.adopt(settings["gemm_algorithm_choices"])
    if settings.get("gemm_epilogues", "off") != "off":  # engines built before the setting existed: off
        rewrites["gemm_epilogue_layers"] = fuse_linear_epilogues(
            module,
            settings["gemm_epilogues"],
            warn_if_none=warn.get("gemm", False),
            merge=bool(settings.get("merge_linears")),
            measure=measure,
        )  # older engines: not merged
    if settings.get("conv_epilogues"):  # older engines: off
        rewrites["conv_epilogue_layers"] = conv_epilogues.fuse_conv_epilogues(module, warn.get("conv", False))
    if scope := settings.get("fused_attention"):  # older engines: off
        taken = fuse_attention(module, masked=scope != "unmasked")
        rewrites["fused_attention_layers"] = {"attention": taken}
    if settings.get("fp8_gelu_epilogues"):  # older engines: off
        rewrites["fp8_epilogue_layers"] = {"linear_bias_gelu_fp8": fuse_fp8_gelu(module, measure)}
    if measure and (taken := measure_fp8_gemms(module)):
        rewrites["measured_fp8_layers"] = {"linear_bias_fp8": taken}
    options = inductor_options(settings)
    compiled = _Configured(torch.compile(module, options=options, dynamic=False), options)
    return (GraphReplays(compiled) if cuda_graphs else compiled), rewrites


class _Configured:
    """A lazily compiled program whose compilations run under a given Inductor config.

    ``torch.compile(options=...)`` alone does not reach freezing (``test_inductor_config_reaches_the_compilation``),
    so the config is also set around the calls that compile: the first call of each input signature (shapes are
    static, so a new signature is what compiles). Later calls skip the patch, which costs host time per call; a
    recompile they trigger anyway (after ``torch.compiler.reset()``, say) still gets the settings ``options``
    carries, not freezing."""

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
    runs Dynamo's guards and the trees' Python book-keeping before the replay, host time a caller waits for with
    the same kernels. Here a call copies its inputs into the graph's input
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
            return self.run(*args)  # the caller (run_compiled) makes it a list
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


def run_compiled(run: Any, args: list[Any]) -> list[Any]:
    """One call of the compiled program (:func:`compile_program`); outputs as a list."""
    out = run(*args)
    return list(out) if isinstance(out, (tuple, list)) else [out]
