"""Runners for ONNX Runtime engines: CPU (plain session) and CUDA (IO binding on device buffers, one CUDA graph
per fixed input shape).

CUDA graphs need fixed shapes and device addresses: for each new set of input shapes the CUDA runner makes a
session from a copy of the model with those shapes pinned (so ORT folds the shape arithmetic and every node can
sit on the GPU), binds static device buffers, and lets ORT capture the graph; later calls with the same shapes
copy the inputs into those buffers and replay. If ORT cannot capture (some node stays on the CPU) the runner
says so in the log and uses IO binding without a graph for that shape.
"""
from __future__ import annotations

import copy
import logging
import time
from typing import Any

import numpy as np
import onnx

from stages.build.engines import Runner

log = logging.getLogger("kiln.build")


def session_options(settings: dict[str, Any]) -> Any:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = settings.get("intra_op_threads", 0)
    opts.inter_op_num_threads = settings.get("inter_op_threads", 0)
    opts.execution_mode = (ort.ExecutionMode.ORT_PARALLEL if settings.get("execution_mode") == "parallel"
                           else ort.ExecutionMode.ORT_SEQUENTIAL)
    opts.log_severity_level = 3
    # Offline optimization already ran; "all" adds only the host-specific layout passes at load.
    opts.graph_optimization_level = {"none": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
                                     "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
                                     "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
                                     "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}[
        settings.get("load_optimization", "none")]
    return opts


def providers_of(settings: dict[str, Any]) -> list[Any]:
    """Providers as stored in JSON (``[name, options]`` pairs) back to what ORT takes (tuples)."""
    return [tuple(p) if isinstance(p, list) else p for p in settings.get("providers", ["CPUExecutionProvider"])]


class OrtCpuRunner(Runner):
    def _activate(self) -> None:
        import onnxruntime as ort

        settings = self.meta.get("session", {})
        self.session = ort.InferenceSession(str(self.engine_dir / self.meta["files"]["model"]),
                                            session_options(settings), providers=providers_of(settings))
        self.output_names = [o.name for o in self.session.get_outputs()]

    def _infer(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(self.output_names, self.session.run(None, feed)))

    def _deactivate(self) -> None:
        del self.session


class OrtCudaRunner(Runner):
    """IO binding on device buffers; CUDA graph replay per input-shape set when the engine enables it."""

    def _activate(self) -> None:
        import onnxruntime as ort

        self.ort, self.settings = ort, self.meta.get("session", {})
        self.model = onnx.load(str(self.engine_dir / self.meta["files"]["model"]))
        self.session = self._session(self.model, graph=False)
        first = providers_of(self.settings)[0]
        self.device_id = int(first[1].get("device_id", 0)) if isinstance(first, tuple) else 0
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.slots: dict[tuple, dict[str, Any]] = {}

    def _session(self, model: onnx.ModelProto, graph: bool) -> Any:
        providers = providers_of(self.settings)
        if graph:
            name, opts = providers[0]
            providers = [(name, {**opts, "enable_cuda_graph": "1"})] + providers[1:]
        return self.ort.InferenceSession(model.SerializeToString(), session_options(self.settings), providers=providers)

    def _slot(self, feed: dict[str, np.ndarray]) -> dict[str, Any]:
        """Device buffers for this shape set: static (graph) or per-call (no graph)."""
        key = tuple((n, feed[n].shape, feed[n].dtype.str) for n in self.input_names)
        if key not in self.slots:
            self.slots[key] = self._graph_slot(feed) if self.meta.get("cuda_graph") else self._plain_slot()
        return self.slots[key]

    def _plain_slot(self) -> dict[str, Any]:
        return {"session": self.session, "binding": self.session.io_binding(), "static": False}

    def _graph_slot(self, feed: dict[str, np.ndarray]) -> dict[str, Any]:
        ov = self.ort.OrtValue
        outs = self.session.run(None, feed)  # output shapes and dtypes for the static buffers
        fixed = pin_shapes(self.model, {n: feed[n].shape for n in self.input_names})
        try:
            session = self._session(fixed, graph=True)
        except Exception as exc:
            log.warning("engine %s: no CUDA graph for shapes %s (%s); using IO binding without it", self.name,
                        {n: feed[n].shape for n in self.input_names}, str(exc).splitlines()[0][:200])
            return self._plain_slot()
        binding = session.io_binding()
        bufs = {n: ov.ortvalue_from_numpy(np.ascontiguousarray(feed[n]), "cuda", self.device_id) for n in self.input_names}
        bufs |= {n: ov.ortvalue_from_shape_and_type(o.shape, o.dtype, "cuda", self.device_id)
                 for n, o in zip(self.output_names, outs)}
        for n in self.input_names:
            binding.bind_ortvalue_input(n, bufs[n])
        for n in self.output_names:
            binding.bind_ortvalue_output(n, bufs[n])
        return {"session": session, "binding": binding, "bufs": bufs, "static": True}

    def _load(self, slot: dict[str, Any], feed: dict[str, np.ndarray]) -> None:
        """Put the inputs on the device: in place for graphs (addresses are baked in), fresh buffers otherwise."""
        if slot["static"]:
            for n in self.input_names:
                slot["bufs"][n].update_inplace(np.ascontiguousarray(feed[n]))
            return
        binding = slot["binding"]
        binding.clear_binding_inputs()
        binding.clear_binding_outputs()
        for n in self.input_names:
            binding.bind_ortvalue_input(n, self.ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(feed[n]),
                                                                                 "cuda", self.device_id))
        for n in self.output_names:
            binding.bind_output(n, "cuda", self.device_id)

    def _infer(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        slot = self._slot(feed)
        self._load(slot, feed)
        slot["session"].run_with_iobinding(slot["binding"])
        return dict(zip(self.output_names, slot["binding"].copy_outputs_to_cpu()))

    def prepared(self, feed: dict[str, np.ndarray]) -> tuple[Any, bool]:
        """``(call, graph)``: ``call()`` runs once on device-resident copies of ``feed`` and returns the first
        output as an ``OrtValue`` on the GPU; ``graph`` says whether it replays a CUDA graph. For benchmarks."""
        slot = self._slot(feed)
        self._load(slot, feed)
        binding = slot["binding"]

        def call() -> Any:
            slot["session"].run_with_iobinding(binding)
            return binding.get_outputs()[0]
        return call, slot["static"]

    def time_ms(self, feed: dict[str, np.ndarray], warmup: int, iterations: int) -> list[float]:
        """Engine time on device buffers (inputs uploaded once, outputs left on the GPU).

        ``run_with_iobinding`` returns after ORT synchronizes its stream, so CUDA events recorded around it on
        torch's stream bracket the whole GPU execution plus launch overhead (what a serving loop pays).
        """
        call, _ = self.prepared(feed)
        for _ in range(max(warmup, 3)):  # ORT captures the CUDA graph during its first runs
            call()
        return _time(call, iterations)

    def _deactivate(self) -> None:
        self.slots.clear()
        del self.session


def _time(fn: Any, iterations: int) -> list[float]:
    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    times = []
    for _ in range(iterations):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def pin_shapes(model: onnx.ModelProto, shapes: dict[str, tuple[int, ...]]) -> onnx.ModelProto:
    """A copy of ``model`` whose inputs have these fixed shapes (ORT then folds the shape arithmetic)."""
    fixed = copy.deepcopy(model)
    for inp in fixed.graph.input:
        if inp.name in shapes:
            for dim, size in zip(inp.type.tensor_type.shape.dim, shapes[inp.name]):
                dim.Clear()
                dim.dim_value = int(size)
    return fixed
