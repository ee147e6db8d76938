"""PyTorch engines: AOTInductor packages compiled from the trained model itself (opt-in: ``build.backends: [...,
torch]``).

``torch.export`` captures the model with a dynamic batch axis, ``torch._inductor.aoti_compile_and_package``
compiles it ahead of time into one ``model.pt2`` (Triton kernels on the GPU, C++ on the CPU), and the runner
loads it with ``aoti_load_package``: no Python model code at serving time. On the GPU: FP16 weights, Inductor's
max-autotune (it benchmarks Triton, cuBLAS and convolution choices per shape) and ``channels_last`` for
convolutions, the settings under which Inductor beat cuDNN on ResNet-18 at batch 32 (issue 12). No INT8: the ONNX
engines carry the calibrated INT8 graphs.

Inputs and outputs keep the ONNX graph's signature and dtypes (the engine casts to FP16 inside), so validation,
gates, serving and the Triton Python backend treat it like any other engine.

A package is tied to the torch that built it (it links libtorch's ABI): the runner refuses another version. On one
GPU host ``aoti_load_package`` segfaulted; the build therefore loads and runs the package once in a child process
(``build.torch.load_check``), so such a package is reported and skipped instead of killing a serving process.
"""
from __future__ import annotations

import logging
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from kiln.core.errors import BuildError, ConfigError
from kiln.core.inputs import random_inputs
from kiln.core.records import EngineMetadata
from kiln.core.text import first_line
from kiln.stages.engines.backend import Backend, BuildRequest, Plan
from kiln.stages.engines.config import BuildConfig, TorchConfig
from kiln.stages.engines.engines import Runner
from kiln.stages.engines.onnxruntime_runner import time_calls

log = logging.getLogger("kiln.build")
PACKAGE = "model.pt2"
NO_MODEL_HINT = ("the torch backend compiles the trained PyTorch model: build it in a workdir (`kiln run`), or use "
                 "--backend onnxruntime for an ONNX file")
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
def _settings(cfg: TorchConfig, device: str, has_conv: bool) -> dict[str, bool]:
    def on(value: str, auto: bool) -> bool:
        return value == "on" or (value == "auto" and auto)
    return {"max_autotune": on(cfg.max_autotune, device == "cuda"), "channels_last": on(cfg.channels_last, has_conv)}


def _served(model: Any, precision: str, channels_last: bool) -> Any:
    """The model as the engine runs it: inputs as the ONNX graph declares them (FP32), cast to the engine's
    precision and memory format inside, outputs back to FP32."""
    import torch

    dtype = torch.float16 if precision == "fp16" else torch.float32

    class Served(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, *xs: torch.Tensor) -> Any:
            xs = tuple(x.to(dtype) if x.is_floating_point() else x for x in xs)
            if channels_last:
                xs = tuple(x.contiguous(memory_format=torch.channels_last) if x.dim() == 4 else x for x in xs)
            out = self.model(*xs)
            if isinstance(out, (tuple, list)):
                return tuple(o.float() if o.is_floating_point() else o for o in out)
            return out.float() if out.is_floating_point() else out

    return Served()


def build_torch_engine(req: BuildRequest) -> dict[str, Any]:
    import torch

    if req.torch_model is None:
        raise ConfigError("the torch backend needs the PyTorch model, and this build has only an ONNX file",
                          hint=NO_MODEL_HINT)
    if req.device == "cuda" and not torch.cuda.is_available():
        raise BuildError("torch sees no CUDA GPU: an AOTInductor CUDA package is compiled and tuned on the GPU",
                         hint="build on the GPU host, or set build.torch.devices: [cpu]")
    model = req.torch_model().eval()
    settings = _settings(req.config.torch, req.device, any(isinstance(m, torch.nn.Conv2d) for m in model.modules()))
    model = model.to(req.device, dtype=torch.float16 if req.precision == "fp16" else torch.float32)
    if settings["channels_last"]:
        model = model.to(memory_format=torch.channels_last)
    served = _served(model, req.precision, settings["channels_last"]).eval()
    feed = random_inputs(req.inputs, batch=2, hint="the torch backend exports with only the batch axis dynamic")
    args = tuple(torch.from_numpy(feed[s.name]).to(req.device) for s in req.inputs)
    # Batch 2 as the example: torch.export specializes sizes 0 and 1; the range still admits batch 1.
    batch = torch.export.Dim("batch", min=1, max=max(req.max_batch, 2))
    dynamic = tuple({0: batch} if s.shape and not isinstance(s.shape[0], int) else {} for s in req.inputs)
    t0 = time.perf_counter()
    try:
        with torch.inference_mode():
            exported = torch.export.export(served, args, dynamic_shapes=(dynamic,))  # (*xs,): one varargs entry
        torch._inductor.aoti_compile_and_package(exported, package_path=str(req.out / PACKAGE),
                                                 inductor_configs={"max_autotune": settings["max_autotune"]})
    except Exception as exc:  # torch.export / Inductor failures: this model cannot become this engine kind
        raise BuildError(f"AOTInductor could not compile the model: {type(exc).__name__}: {first_line(exc, 300)}",
                         hint="the ONNX engines still build; see torch.export's docs for unsupported code") from None
    compile_s = round(time.perf_counter() - t0, 2)
    if req.config.torch.load_check:
        _load_check(req.out / PACKAGE, args, req.device, req.config.torch.load_check_timeout_s)
    return {"files": {"model": PACKAGE}, "flavour": "aotinductor", "versions": {"torch": torch.__version__},
            "builder_settings": {**settings, "dtype": "float16" if req.precision == "fp16" else "float32",
                                 "compile_seconds": compile_s, "dynamic_batch": [1, max(req.max_batch, 2)]}}


def _load_check(package: Path, args: tuple[Any, ...], device: str, timeout: float) -> None:
    """Load and run the package once in a child process; a crash or error there is a :class:`BuildError`."""
    import torch

    with tempfile.TemporaryDirectory(prefix="kiln-aoti-") as tmp:
        sample = Path(tmp) / "args.pt"
        torch.save(tuple(a.cpu() for a in args), sample)
        try:
            done = subprocess.run([sys.executable, "-c", _LOAD_CHECK, str(package), str(sample), device],
                                  capture_output=True, text=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            raise BuildError(f"loading the AOTInductor package took over {timeout:.0f}s",
                             hint="raise build.torch.load_check_timeout_s") from None
    if done.returncode != 0:
        why = (f"killed by {signal.Signals(-done.returncode).name}" if done.returncode < 0
               else (done.stderr.strip().splitlines() or ["exit " + str(done.returncode)])[-1][:300])
        raise BuildError(f"the AOTInductor package does not load in a fresh process ({why})",
                         hint="check that the torch that built it is the one importable here (one torch, not a "
                              "second one staged on PYTHONPATH), and that libstdc++/CUDA libraries match")


# ------------------------------------------------------------------------------------------------------ runner
class TorchRunner(Runner):
    """``aoti_load_package`` on the engine's device; numpy in and out, inputs in the engine's declared order."""

    def _activate(self) -> None:
        import torch
        from torch._inductor import aoti_load_package

        self.torch = torch
        self.device = torch.device("cuda", 0) if self.meta.device == "cuda" else torch.device("cpu")
        self.package = aoti_load_package(str(self.engine_dir / self.meta.files["model"]))
        self.output_names = [o.name for o in self.meta.outputs]

    def _call(self, args: list[Any]) -> list[Any]:
        with self.torch.inference_mode():
            out = self.package(*args)
        return list(out) if isinstance(out, (tuple, list)) else [out]

    def _args(self, feed: dict[str, np.ndarray]) -> list[Any]:
        return [self.torch.from_numpy(np.ascontiguousarray(feed[n])).to(self.device) for n in self.input_names]

    def _infer(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {n: o.cpu().numpy() for n, o in zip(self.output_names, self._call(self._args(feed)))}

    def prepared(self, feed: dict[str, np.ndarray]) -> tuple[Any, bool]:
        """``(call, graph)`` as the ORT CUDA runner's: ``call()`` runs once on device-resident copies of ``feed``,
        waits for the device, and returns the first output on the device; no CUDA graph. For timing."""
        args = self._args(feed)

        def call() -> Any:
            out = self._call(args)[0]
            if self.meta.device == "cuda":
                self.torch.cuda.current_stream().synchronize()
            return out
        return call, False

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
    skipped = [f"torch-{d}-{precision}: AOTInductor engines are FP32, or FP16 on the GPU"
               for d in cfg.torch.devices if d not in devices]
    return Plan(devices, skipped)


def _can_run(meta: EngineMetadata) -> tuple[bool, str]:
    import torch

    built = meta.versions.get("torch")
    if built != torch.__version__:
        return False, (f"built with torch {built}, this is torch {torch.__version__} (AOTInductor packages are "
                       "tied to the torch that built them)")
    if meta.device == "cuda" and not torch.cuda.is_available():
        return False, "torch sees no CUDA GPU"
    return True, ""


BACKEND = Backend(
    name="torch", devices=("cpu", "cuda"), settings=lambda cfg: cfg.torch, plan=_plan, build=build_torch_engine,
    runners={"cpu": TorchRunner, "cuda": TorchRunner}, can_run=_can_run, triton=None,
    # opt-in and model-dependent (torch.export cannot capture every model): a failure skips it, reported
    optional=lambda cfg: True, rank=20,
)
