"""Running a torch engine: an AOTInductor package loaded with ``aoti_load_package``, or the compiled flavour's
program compiled from the build's caches (:mod:`.program`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from kiln.core.errors import ModelError
from kiln.core.timing import time_calls
from kiln.stages.engines.backend import Runner
from kiln.stages.engines.torch.program import GraphReplays, compile_program, run_compiled


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
            self.package, _ = compile_program(
                self.engine_dir / self.meta.files["program"], settings, bool(settings.get("cuda_graphs"))
            )
            return
        from torch._inductor import aoti_load_package

        self.package = aoti_load_package(str(self.engine_dir / self.meta.files["model"]))

    def _call(self, args: list[Any]) -> list[Any]:
        with self.torch.inference_mode():
            if self.meta.flavour == "compiled":
                return run_compiled(self.package, args)
            out = self.package(*args)
        return list(out) if isinstance(out, (tuple, list)) else [out]

    def _host_array(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """On CUDA, page-locked memory: the upload is one DMA queued on the stream, not a copy through the
        driver's staging buffers in the caller's thread. The array's base is its page-locked tensor (:meth:`_args`
        finds it there)."""
        if self.device.type != "cuda":
            return super()._host_array(shape, dtype)
        return self.torch.from_numpy(np.empty(0, dtype)).new_empty(shape).pin_memory().numpy()

    def _args(self, feed: dict[str, np.ndarray]) -> list[Any]:
        return [self._upload(feed[n]) for n in self.input_names]

    def _upload(self, array: np.ndarray) -> Any:
        base = array.base
        if (
            isinstance(base, self.torch.Tensor)
            and base.data_ptr() == array.ctypes.data
            and tuple(base.shape) == array.shape
            and base.is_pinned()
        ):
            # a page-locked buffer (:meth:`_host_array`): the outputs' download waits for this copy on the same
            # stream before the call returns, so the caller may write the buffer again after it
            return base.to(self.device, non_blocking=True)
        return self.torch.from_numpy(np.ascontiguousarray(array)).to(self.device)

    def _infer(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.meta.axis_steps:  # the compiled program answers a size between its steps with a wrong shape
            outside = self.meta.outside_range({k: v.shape for k, v in feed.items()})
            if outside is not None:
                raise ModelError(outside, hint="call the engine at the sizes it was validated for")
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

    def time_ms(
        self, feed: dict[str, np.ndarray], warmup: int, iterations: int, budget_s: float | None = None
    ) -> list[float]:
        """Engine time on device-resident inputs, outputs left on the device (as the ORT CUDA runner times)."""
        if self.meta.device != "cuda":
            return super().time_ms(feed, warmup, iterations, budget_s)
        call, _ = self.prepared(feed)
        for _ in range(max(warmup, 3)):
            call()
        return time_calls(call, iterations, budget_s=budget_s)

    def _deactivate(self) -> None:
        del self.package
