"""torch.compile in the training loop (``train.compile``): compile the module the loop calls, fall back to eager,
count graphs.

Under DDP the compiled module is the ``DistributedDataParallel`` wrapper, as PyTorch recommends: Dynamo's
DDPOptimizer then splits the graph at DDP's bucket boundaries, so each bucket's all-reduce overlaps the backward
pass of the layers before it. Dynamo breaks the graph in DDP's own forward, so ``fullgraph: true`` cannot hold
under DDP and is refused there.

Only the forward (and, through AOTAutograd, its backward) is compiled; the loss, GradScaler, clipping, the optimizer
step and the step checks run around it as they do without compiling. The loop keeps the uncompiled module for
``state_dict``, so checkpoints never carry the ``_orig_mod.`` prefix.

Shapes: by default the graphs are static, compiled for a full batch's micro-batch shapes, and a call with any other
shape (an epoch's shorter last batch) runs the eager module: automatic dynamic shapes would recompile the frame with a
symbolic batch, and every later full batch would then run the slower dynamic-shape kernels. ``dynamic: true``
compiles one dynamic graph for every shape.

CUDA graphs (``reduce-overhead``, ``max-autotune``) keep each replay's outputs in a pool the next replay overwrites,
and a parameter's first gradient is installed as ``.grad`` without a copy; with accumulation the loop therefore keeps
``.grad`` allocated (:attr:`CompiledModel.keeps_grads`) and zeroes it in place, so autograd adds into it.

Compilation is lazy (on the first call, and the first backward); a failure makes the loop go on eagerly with one
warning, or stops training with a :class:`TrainingError` under ``fullgraph: true``.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kiln.core.data import Inputs, call
from kiln.core.errors import TrainingError
from kiln.core.text import first_line
from kiln.stages.train.config import CompileConfig

log = logging.getLogger("kiln.train")

CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


@dataclass
class CompileCounts:
    """Dynamo's process-wide counters at one moment; the difference of two is what happened in between.

    ``torch._dynamo.utils.counters`` and ``get_compilation_metrics()`` are the sources ``torch._dynamo``'s
    own tests and ``tlparse`` use; there is no public API for them yet, so a torch without them gives zeros.
    """

    graphs: int = 0
    breaks: dict[str, int] = field(default_factory=dict)
    compiles: set[int] = field(default_factory=set)  # ids of the CompilationMetrics records seen

    @classmethod
    def now(cls) -> CompileCounts:
        import torch._dynamo.utils  # imported only when compiling: a heavy import (it probes for TensorRT)

        utils: Any = torch._dynamo.utils
        counters = getattr(utils, "counters", {})
        metrics = getattr(utils, "get_compilation_metrics", lambda: [])()
        return cls(
            int(counters.get("stats", {}).get("unique_graphs", 0)),
            dict(counters.get("graph_break", {})),
            {id(m) for m in metrics},
        )

    def since(self, before: CompileCounts) -> dict[str, Any]:
        """Graphs compiled, recompiles (with Dynamo's reasons), graph breaks (with reasons) and compile time."""
        new = [
            m
            for m in getattr(torch._dynamo.utils, "get_compilation_metrics", lambda: [])()
            if id(m) not in before.compiles
        ]
        recompiles = [_first_line(m.recompile_reason) for m in new if getattr(m, "recompile_reason", None)]
        breaks = {
            _first_line(k): n - before.breaks.get(k, 0) for k, n in self.breaks.items() if n > before.breaks.get(k, 0)
        }
        return {
            "graphs": self.graphs - before.graphs,
            "recompiles": len(recompiles),
            "recompile_reasons": list(dict.fromkeys(recompiles))[:5],
            "graph_breaks": sum(breaks.values()),
            "graph_break_reasons": list(breaks)[:5],
            "compile_s": round(sum((getattr(m, "duration_us", 0) or 0) for m in new) / 1e6, 2),
        }


class CompiledModel:
    """The callable the loop runs the model through: ``torch.compile``'d, or the eager module itself.

    A compile failure in a forward call is handled here (one warning, then eager for the rest of the run);
    one in a backward pass surfaces in the loop, which catches :attr:`errors`, calls :meth:`fall_back` and
    redoes the step.
    """

    def __init__(
        self, module: nn.Module, options: CompileConfig | None, device: torch.device = torch.device("cpu")
    ) -> None:
        self.eager, self.options, self.device = module, options, device
        self.fallback: str | None = None  # why the run went back to eager mode
        self.forward: Any = module
        self.mark_steps = False
        # Static graphs (see the module docstring): the input shapes they serve, and calls run eagerly instead
        self.static = options is not None and not options.dynamic
        self.shapes: set[Signature] = set()
        self.eager_calls = 0
        # What a failed compilation raises (BackendCompilerFailed, InductorError, Unsupported with fullgraph, ...);
        # nothing when not compiling (an empty tuple in an except clause catches nothing).
        self.errors: tuple[type[BaseException], ...] = ()
        if options is None:
            return
        import torch._dynamo  # only when compiling (see CompileCounts.now)

        self.errors = (torch._dynamo.exc.TorchDynamoException,)
        self.before = CompileCounts.now()
        if options.fullgraph and isinstance(module, nn.parallel.DistributedDataParallel):
            raise TrainingError(
                "train.compile.fullgraph: true does not work with several processes: torch.compile of the "
                "DistributedDataParallel module (the order PyTorch recommends) always breaks the graph in DDP's own "
                "forward",
                hint="set train.compile.fullgraph: false (graph breaks are counted in the training "
                "summary), or check fullgraph with one process (nproc_per_node: 1)",
            )
        try:
            self.forward = torch.compile(
                module, mode=options.mode, dynamic=bool(options.dynamic), fullgraph=options.fullgraph
            )
        except Exception as exc:  # e.g. a Python version Dynamo does not support: raised by torch.compile itself
            self.fall_back(exc)
        # CUDA graph trees reuse their output memory from one iteration to the next and guess where an iteration
        # begins; with accumulation (K forward/backward pairs per step) and evaluation Kiln says so itself, before
        # every call (torch.compiler.cudagraph_mark_step_begin): each call's outputs are used up before the next.
        self.mark_steps = options.mode in CUDA_GRAPH_MODES

    @property
    def compiled(self) -> bool:
        return self.forward is not self.eager

    @property
    def keeps_grads(self) -> bool:
        """Must ``.grad`` stay allocated (zeroed in place, never set to None)? With CUDA graphs: see the module
        docstring."""
        return self.compiled and self.mark_steps and self.device.type == "cuda"

    def serve_shapes_of(self, inputs: list[Inputs]) -> None:
        """Static graphs serve the shapes of these inputs (a full batch's micro-batches); others run eagerly."""
        for x in inputs:  # call(): the structure the loop calls the model with (x, *x or **x)
            call(lambda *args, **kwargs: self.shapes.add(signature(args, kwargs)), x)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Any call structure: model(x), model(*x), model(**x) (kiln.core.data.call), any output structure
        if not self.compiled:
            return self.eager(*args, **kwargs)
        if self.static and signature(args, kwargs) not in self.shapes:
            self.eager_calls += 1
            return self.eager(*args, **kwargs)
        if self.mark_steps:
            torch.compiler.cudagraph_mark_step_begin()
        try:
            return self.forward(*args, **kwargs)
        except self.errors as exc:
            self.fall_back(exc)
            return self.eager(*args, **kwargs)

    def fall_back(self, exc: BaseException) -> None:
        """Continue in eager mode after a compile failure, or (``fullgraph: true``) stop with a clear error."""
        assert self.options is not None
        # BackendCompilerFailed/InductorError carry the compiler's own error as inner_exception
        reason = (
            f"{type(exc).__name__}: {first_line(getattr(exc, 'inner_exception', None) or exc)}{_user_frame(str(exc))}"
        )
        if self.options.fullgraph:
            raise TrainingError(
                f"torch.compile with train.compile.fullgraph: true could not compile the model as one graph: {reason}",
                hint="remove the graph break it names (e.g. .item(), print or data-dependent Python control flow in "
                "forward), or set train.compile.fullgraph: false to let torch.compile split the graph",
            ) from None
        log.warning(
            "torch.compile failed, training continues in eager mode (train.compile.fullgraph: true makes "
            "this an error): %s",
            reason,
        )
        self.fallback, self.forward = reason, self.eager

    def summary(self, run_s: float | None = None) -> dict[str, Any] | None:
        """For the training summary: settings, outcome, and what Dynamo compiled during the run; with ``run_s``
        (the wall time of the training loop, compiling included) also whether compiling paid (:func:`compile_paid`).
        """
        if self.options is None:
            return None
        out = {
            **self.options.model_dump(),
            "compiled": self.compiled,
            "fallback": self.fallback,
            "eager_calls": self.eager_calls,
            **CompileCounts.now().since(self.before),
        }
        if run_s is not None and self.compiled:
            out["after_compile_s"] = round(max(run_s - out["compile_s"], 0.0), 2)
            out["paid"] = compile_paid(out["compile_s"], out["after_compile_s"])
        return out


def compile_paid(compile_s: float, after_compile_s: float) -> bool:
    """Whether compiling can have paid in this run: not when it took longer than all the training after it, which
    the faster kernels would have had to speed up by more than twice (an eager run of the same length has no
    compile time to win back). A run holds no eager reference to compare samples/s with, so this is the test."""
    return compile_s <= after_compile_s


def unpaid_warning(summary: dict[str, Any], device: str) -> str | None:
    """The warning for a compiled run whose compile time did not pay (:func:`compile_paid`), None otherwise: the
    numbers of the run, and the setting that turns compiling off."""
    if summary.get("paid", True):
        return None
    where = "on this CPU it did not pay" if device.startswith("cpu") else "in a run this short it did not pay"
    return (
        f"train.compile took {summary['compile_s']:.0f} s to compile and training ran {summary['after_compile_s']:.0f} "
        f"s after it: {where}; set train.compile: false"
    )


Signature = tuple[tuple[tuple[int, ...], torch.dtype] | None, ...]


def signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Signature:
    """Shapes and dtypes of a call's tensors (None for other arguments), in call order."""
    leaves = [*args, *(kwargs[k] for k in sorted(kwargs))]
    return tuple((tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else None for v in leaves)


def _user_frame(text: str) -> str:
    """ " (at file:line in fn: code)" from the "from user code:" part of a Dynamo error, where it has one."""
    match = re.search(r'from user code:\s*File "([^"]+)", line (\d+), in (\w+)\s*\n\s*(.+)', text)
    if match is None:
        return ""
    path, line, fn, code = match.groups()
    return f" (at {Path(path).name}:{line} in {fn}: {code.strip()})"


def _first_line(text: str | None) -> str:
    line = (text or "").strip().splitlines()[0] if (text or "").strip() else ""
    return line if len(line) <= 300 else line[:300] + " ..."
