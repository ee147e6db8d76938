"""Running a TensorRT engine: where it can run, and a runner (``execute_async_v3``, torch device buffers,
optional CUDA graph per input shape).

Written against TensorRT's documented Python API. Where an engine cannot run (no GPU, TensorRT-RTX on a compute
capability it does not support, another TensorRT version), :func:`can_execute` says why and validation reports the
engine as not runnable instead of failing.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from kiln.core.errors import BackendUnavailable, BuildError
from kiln.core.records import EngineMetadata
from kiln.core.timing import MIN_TIMED
from kiln.stages.engines.backend import Runner
from kiln.stages.engines.tensorrt import cache as tensorrt_cache
from kiln.stages.engines.tensorrt.errors import KilnTrtLogger, gc_paused_for_tensorrt
from kiln.stages.engines.tensorrt.lib import import_tensorrt
from kiln.stages.engines.tensorrt.profiles import profile_for
from kiln.stages.engines.tensorrt.record import TensorRTRecord

log = logging.getLogger("kiln.build")


def can_execute(trt: ModuleType | None, meta: EngineMetadata | None = None) -> tuple[bool, str]:
    """Whether ``trt`` can execute (this) engine on this machine, and why not."""
    if trt is None:
        flavour = meta.flavour if meta else "tensorrt"
        return False, f"{flavour} is not installed here, so its engine cannot run"
    import torch

    if not torch.cuda.is_available():
        return False, f"{trt.__name__} needs a CUDA GPU to run engines; none is visible on this machine"
    cc = "".join(map(str, torch.cuda.get_device_capability(0)))
    if trt.__name__ == "tensorrt_rtx" and f"SM{cc}" not in trt.ComputeCapability.__members__:
        supported = sorted(m for m in trt.ComputeCapability.__members__ if m.startswith("SM"))
        return False, (
            f"TensorRT-RTX {trt.__version__} does not support this GPU's compute capability "
            f"{cc[:-1]}.{cc[-1]} (it supports {', '.join(supported)})"
        )
    if meta is not None:
        built = meta.versions.get(trt.__name__)
        if built and built != trt.__version__:
            return False, f"engine built with {trt.__name__} {built}, this machine has {trt.__version__}: rebuild it"
        target = TensorRTRecord.model_validate(meta.backend_info).target
        targets = target.get("compute_capabilities") or []
        explicit = [t for t in targets if t.startswith("SM")]
        if explicit and f"SM{cc}" not in explicit:
            return False, f"engine built for {', '.join(explicit)}, this GPU is SM{cc}: rebuild for it"
        local = (target.get("local_gpu") or {}).get("compute_capability")
        if trt.__name__ == "tensorrt" and local and local.replace(".", "") != cc:
            return False, f"engine tuned for compute capability {local}, this GPU is {cc[:-1]}.{cc[-1]}: rebuild it"
    return True, ""


class TensorRTRunner(Runner):
    """Device buffers from torch; one CUDA graph per input shape when ``cuda_graph`` is on (TensorRT 10/11)."""

    def _activate(self) -> None:
        with gc_paused_for_tensorrt():  # our Python logger runs inside TensorRT's locks
            self._load()

    def _load(self) -> None:
        import torch

        trt = self.trt = import_tensorrt(self.meta.flavour)
        self.torch, self.logger = torch, KilnTrtLogger(trt)
        self.engine = trt.Runtime(self.logger).deserialize_cuda_engine((self.engine_dir / "engine.plan").read_bytes())
        if self.engine is None:
            raise BackendUnavailable(f"cannot load engine {self.name}: {self.logger.last_errors()}")
        self.runtime_cache = None
        if hasattr(self.engine, "create_runtime_config"):  # TensorRT-RTX: JIT kernels cached across runs
            rc = self.engine.create_runtime_config()
            recorded = Path(self.info.runtime_cache) if self.info.runtime_cache else None
            # the build's cache folder, where it exists (this machine, this workdir): never one made elsewhere
            self.cache_path = recorded if recorded and recorded.is_absolute() and recorded.parent.is_dir() else None
            if self.cache_path:
                self.runtime_cache = tensorrt_cache.load_runtime_cache(rc, self.cache_path)
            if self.info.cuda_graph and hasattr(trt, "CudaGraphStrategy"):
                rc.cuda_graph_strategy = trt.CudaGraphStrategy.WHOLE_GRAPH_CAPTURE
            self.context = self.engine.create_execution_context(rc)
        else:
            self.context = self.engine.create_execution_context()
        self.stream = torch.cuda.Stream()
        self.names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.outputs = [n for n in self.names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        self.use_graph = bool(self.info.cuda_graph) and self.runtime_cache is None
        self.slots: dict[tuple, dict[str, Any]] = {}  # input shapes -> static buffers (+ graph)

    def _slot(self, feed: dict[str, np.ndarray]) -> dict[str, Any]:
        """Static device buffers for these input shapes, addresses bound, graph captured once."""
        torch, trt = self.torch, self.trt
        key = tuple((n, feed[n].shape) for n in self.input_names)
        if key in self.slots:
            return self.slots[key]
        idx = profile_for(self.info.profiles, {n: feed[n].shape for n in self.input_names}) or 0
        self.context.set_optimization_profile_async(idx, self.stream.cuda_stream)
        bufs: dict[str, Any] = {}
        for n in self.input_names:
            bufs[n] = torch.from_numpy(np.ascontiguousarray(feed[n])).to("cuda")
            self.context.set_input_shape(n, tuple(feed[n].shape))
        for n in self.outputs:
            dtype = torch.from_numpy(np.empty(0, dtype=trt.nptype(self.engine.get_tensor_dtype(n)))).dtype
            bufs[n] = torch.empty(tuple(self.context.get_tensor_shape(n)), dtype=dtype, device="cuda")
        for n, t in bufs.items():
            self.context.set_tensor_address(n, t.data_ptr())
        slot: dict[str, Any] = {"bufs": bufs, "graph": None}
        self._launch(slot)  # first run outside capture: TensorRT allocates lazily on it
        if self.use_graph:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=self.stream):
                self.context.execute_async_v3(self.stream.cuda_stream)
            slot["graph"] = graph
        self.slots[key] = slot
        return slot

    def _launch(self, slot: dict[str, Any]) -> None:
        with self.torch.cuda.stream(self.stream):
            if slot["graph"] is not None:
                slot["graph"].replay()
            elif not self.context.execute_async_v3(self.stream.cuda_stream):
                raise BuildError(f"engine {self.name} failed to execute: {self.logger.last_errors()}")

    def _infer(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        slot = self._slot(feed)
        if len(self.slots) > 1 or not self.use_graph:  # buffers are bound per shape; rebind when shapes alternate
            self._bind(slot, feed)
        for n in self.input_names:
            slot["bufs"][n].copy_(self.torch.from_numpy(np.ascontiguousarray(feed[n])), non_blocking=False)
        self._launch(slot)
        self.stream.synchronize()
        return {n: slot["bufs"][n].cpu().numpy() for n in self.outputs}

    def _bind(self, slot: dict[str, Any], feed: dict[str, np.ndarray]) -> None:
        for n in self.input_names:
            self.context.set_input_shape(n, tuple(feed[n].shape))
        for n, t in slot["bufs"].items():
            self.context.set_tensor_address(n, t.data_ptr())

    def time_ms(
        self, feed: dict[str, np.ndarray], warmup: int, iterations: int, budget_s: float | None = None
    ) -> list[float]:
        """GPU time of the engine on device buffers (inputs copied once), measured with CUDA events."""
        self.infer(feed, allow_outside_ranges=True)  # checks the feed; a size is timed, not judged (Runner.time_ms)
        slot = self._slot(feed)
        self._bind(slot, feed)
        times: list[float] = []
        deadline = time.perf_counter() + budget_s if budget_s is not None else float("inf")
        for i in range(warmup + iterations):
            if len(times) >= MIN_TIMED and time.perf_counter() > deadline:
                break
            start, end = self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True)
            start.record(self.stream)  # on the engine's stream, which the events must bracket
            self._launch(slot)
            end.record(self.stream)
            end.synchronize()
            if i >= warmup:
                times.append(start.elapsed_time(end))
        return times

    def _deactivate(self) -> None:
        if self.runtime_cache is not None and self.cache_path:
            tensorrt_cache.save_runtime_cache(self.runtime_cache, self.cache_path)
        self.slots.clear()
        del self.context, self.engine
