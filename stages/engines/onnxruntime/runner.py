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
import os
import re
from typing import Any

import numpy as np
import onnx

from kiln.core.errors import BuildError, KilnError
from kiln.core.onnx_io import ort_session
from kiln.core.onnx_io import session_options as make_options
from kiln.core.text import short_reason
from kiln.core.timing import time_calls
from kiln.stages.engines.backend import Runner
from kiln.stages.engines.onnxruntime.record import OrtRecord

log = logging.getLogger("kiln.build")


def session_options(settings: dict[str, Any]) -> Any:
    """Session options from an engine's recorded settings. Offline optimization already ran; "all" at load adds
    only the host-specific layout passes."""
    return make_options(
        threads=settings.get("intra_op_threads", 0),
        inter_threads=settings.get("inter_op_threads", 0),
        parallel=settings.get("execution_mode") == "parallel",
        optimization=settings.get("load_optimization", "none"),
        spinning=settings.get("spinning", True),
    )


def session_refusal(exc: BaseException) -> str:
    """ONNX Runtime's reason for refusing a session, on one line: the innermost of its nested errors (the outer
    ones name the source line that passed it on). ``ort_session``'s error keeps only the first line of ORT's
    message, so ORT's own exception (its context) is read where there is one."""
    text = str(exc.__context__ or exc)
    inner = re.split(r"\[ONNXRuntimeError\] : \d+ : \w+ : ", text)[-1]
    return short_reason(inner if inner.strip() else text, 240)


def load_error(exc: KilnError, engine: str, settings: dict[str, Any], built_with: str | None) -> KilnError:
    """``exc`` (ORT refusing to open an engine's graph) with a fix that holds for an engine. A graph ORT optimized
    offline ran in ORT when it was built, so another opset is no fix for it: the graph is ORT's own output, and
    a build with the onnxruntime that loads it checks that it opens and falls back to a level or graph that does.
    An un-optimized engine graph keeps ``exc``'s hint (an op or type ORT may not support)."""
    offline = settings.get("offline_optimization", "none")
    if offline == "none":
        return exc
    import onnxruntime as ort

    return BuildError(
        f"ONNX Runtime cannot load engine {engine}: {session_refusal(exc)}",
        hint=f"the engine is ONNX Runtime's own optimized graph (offline_optimization '{offline}', opened at"
        f" load_optimization '{settings.get('load_optimization', 'none')}'; built with onnxruntime"
        f" {built_with or 'unknown'}, this is {ort.__version__}): rebuild it here (`kiln build`, or `kiln run"
        " --force build` in a workdir); the build checks that its engine loads and falls back to one that does",
    )


def for_server(plan: dict[str, Any], serving: bool) -> dict[str, Any]:
    """``plan`` for a runner inside a server (``serving``): its thread pools do not busy-wait between calls, which
    there takes cores from the server's own threads and the other stubs (docs/serving.md).
    ``KILN_ORT_SPINNING=1`` keeps ORT's default, for a server whose engine has cores of its own."""
    if not serving or os.environ.get("KILN_ORT_SPINNING") == "1":
        return plan
    return {**plan, "settings": {**plan["settings"], "spinning": False}}


def providers_of(settings: dict[str, Any]) -> list[Any]:
    """Providers as stored in JSON (``[name, options]`` pairs) back to what ORT takes (tuples)."""
    return [tuple(p) if isinstance(p, list) else p for p in settings.get("providers", ["CPUExecutionProvider"])]


# Autotuning knobs -> where they land: a CUDA provider option (with its value encoder), a session setting, the
# runner's CUDA-graph switch, or the model file. Plain dicts so the autotuner and the runner share one meaning.
CUDA_OPTION_KNOBS: dict[str, tuple[str, Any]] = {
    "prefer_nhwc": ("prefer_nhwc", lambda v: "1" if v else "0"),
    "conv_algo_search": ("cudnn_conv_algo_search", str),
    "conv_max_workspace": ("cudnn_conv_use_max_workspace", lambda v: "1" if v else "0"),
}
SESSION_KNOBS = {"intra_op_threads", "inter_op_threads", "execution_mode", "load_optimization"}
OTHER_KNOBS = {"cuda_graph", "transformer_fusion"}
KNOBS = set(CUDA_OPTION_KNOBS) | SESSION_KNOBS | OTHER_KNOBS


def plan_for(
    files: dict[str, str], session: dict[str, Any] | None, cuda_graph: bool, knobs: dict[str, Any]
) -> dict[str, Any]:
    """How to open the engine (its ``files``, built ``session`` settings and ``cuda_graph`` switch) with these knob
    values: ``{model, settings, providers, cuda_graph}``."""
    settings = {**(session or {}), **{k: v for k, v in knobs.items() if k in SESSION_KNOBS}}
    providers = providers_of(settings)
    if providers and isinstance(providers[0], tuple):
        name, opts = providers[0]
        opts = {
            **opts,
            **{CUDA_OPTION_KNOBS[k][0]: CUDA_OPTION_KNOBS[k][1](v) for k, v in knobs.items() if k in CUDA_OPTION_KNOBS},
        }
        providers = [(name, opts)] + providers[1:]
    model = files.get("model_unfused", files["model"]) if knobs.get("transformer_fusion") is False else files["model"]
    return {
        "model": model,
        "settings": settings,
        "providers": providers,
        "cuda_graph": bool(knobs.get("cuda_graph", cuda_graph)),
    }


def engine_plan(files: dict[str, str], info: OrtRecord, batch: int | None) -> dict[str, Any]:
    """The plan a built engine runs with at this batch size (``None``: any)."""
    return plan_for(files, info.session, info.cuda_graph, chosen_knobs(info.autotune, batch))


def chosen_knobs(autotune: dict[str, Any] | None, batch: int | None) -> dict[str, Any]:
    """The autotuned knobs for this batch size: its own choice, else the next larger tuned batch (kernels picked
    for more work degrade least), else the largest; ``{}`` (the built settings) when nothing was tuned."""
    tuned = autotune or {}
    by_batch = {int(b): c["knobs"] for b, c in (tuned.get("choice_by_batch") or {}).items()}
    if batch is None or not by_batch:
        return dict(tuned.get("choice", {}).get("knobs", {}))
    bigger = [b for b in sorted(by_batch) if b >= batch]
    return dict(by_batch[bigger[0] if bigger else max(by_batch)])


def open_session(ort: Any, model: onnx.ModelProto, plan: dict[str, Any], graph: bool = False) -> Any:
    providers = plan["providers"]
    if graph:
        name, opts = providers[0]
        providers = [(name, {**opts, "enable_cuda_graph": "1"})] + providers[1:]
    return ort_session(model, providers=providers, options=session_options(plan["settings"]), error=BuildError)


def cuda_slot(
    ort: Any,
    model: onnx.ModelProto,
    plan: dict[str, Any],
    feed: dict[str, np.ndarray],
    out_like: dict[str, np.ndarray],
    device_id: int,
    engine: str = "",
) -> dict[str, Any]:
    """A session for these fixed input shapes with IO binding, ready to run: static device buffers and a CUDA graph
    when ``plan`` asks for one (falling back to plain IO binding with a warning if ORT cannot capture)."""
    ov = ort.OrtValue
    shapes = {n: feed[n].shape for n in feed}
    fixed = pin_shapes(model, shapes)  # fixed shapes: ORT folds the shape arithmetic, every node can sit on the GPU
    static = plan["cuda_graph"]
    if static:
        try:
            session = open_session(ort, fixed, plan, graph=True)
        except Exception as exc:
            log.warning(
                "engine %s: no CUDA graph for shapes %s (%s); using IO binding without it",
                engine,
                shapes,
                short_reason(exc, 200),
            )
            static = False
    if not static:
        session = open_session(ort, fixed, plan)
    binding = session.io_binding()
    slot = {"session": session, "binding": binding, "static": static, "inputs": list(feed), "device_id": device_id}
    if static:
        bufs = {n: ov.ortvalue_from_numpy(np.ascontiguousarray(a), "cuda", device_id) for n, a in feed.items()}
        bufs |= {n: ov.ortvalue_from_shape_and_type(o.shape, o.dtype, "cuda", device_id) for n, o in out_like.items()}
        for n in feed:
            binding.bind_ortvalue_input(n, bufs[n])
        for n in out_like:
            binding.bind_ortvalue_output(n, bufs[n])
        slot["bufs"] = bufs
    slot["outputs"] = list(out_like)
    return slot


def load_slot(ort: Any, slot: dict[str, Any], feed: dict[str, np.ndarray]) -> None:
    """Put the inputs on the device: in place for graphs (addresses are baked in), fresh buffers otherwise."""
    if slot["static"]:
        for n in slot["inputs"]:
            slot["bufs"][n].update_inplace(np.ascontiguousarray(feed[n]))
        return
    binding, dev = slot["binding"], slot["device_id"]
    binding.clear_binding_inputs()
    binding.clear_binding_outputs()
    for n in slot["inputs"]:
        binding.bind_ortvalue_input(n, ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(feed[n]), "cuda", dev))
    for n in slot["outputs"]:
        binding.bind_output(n, "cuda", dev)


class OrtCpuRunner(Runner):
    """One session with the autotuned (or built) settings: CPU sessions take any shape, so one choice serves all."""

    def _activate(self) -> None:

        plan = for_server(engine_plan(self.meta.files, self.info, None), self.serving)
        try:
            self.session = ort_session(
                self.engine_dir / plan["model"],
                providers=plan["providers"],
                options=session_options(plan["settings"]),
                error=BuildError,
            )
        except BuildError as exc:
            raise load_error(exc, self.name, plan["settings"], self.meta.versions.get("onnxruntime")) from None
        self.output_names = [o.name for o in self.session.get_outputs()]

    def _infer(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(self.output_names, self.session.run(None, feed)))

    def _deactivate(self) -> None:
        del self.session


class OrtCudaRunner(Runner):
    """IO binding on device buffers; per input-shape set a fixed-shape session with the settings autotuned for that
    batch (``kiln-engine.json`` ``autotune``), replaying a CUDA graph when the choice uses one."""

    per_shape_sessions = True  # a new input shape builds a session: servers pad batches to a few sizes

    def _activate(self) -> None:
        import onnxruntime as ort

        self.ort, self.models = ort, {}
        base = for_server(plan_for(self.meta.files, self.info.session, self.info.cuda_graph, {}), self.serving)
        try:
            self.session = open_session(ort, self._model(base["model"]), base)  # any shape: gives output shapes
        except BuildError as exc:
            raise load_error(exc, self.name, base["settings"], self.meta.versions.get("onnxruntime")) from None
        first = base["providers"][0]
        self.device_id = int(first[1].get("device_id", 0)) if isinstance(first, tuple) else 0
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.slots: dict[tuple, dict[str, Any]] = {}

    def _model(self, file: str) -> onnx.ModelProto:
        if file not in self.models:
            self.models[file] = onnx.load(str(self.engine_dir / file))
        return self.models[file]

    def _slot(self, feed: dict[str, np.ndarray]) -> dict[str, Any]:
        key = tuple((n, feed[n].shape, feed[n].dtype.str) for n in self.input_names)
        if key not in self.slots:
            feed = {n: feed[n] for n in self.input_names}
            plan = for_server(
                engine_plan(self.meta.files, self.info, int(feed[self.input_names[0]].shape[0])), self.serving
            )
            outs = dict(zip(self.output_names, self.session.run(None, feed)))
            self.slots[key] = cuda_slot(
                self.ort, self._model(plan["model"]), plan, feed, outs, self.device_id, self.name
            )
        return self.slots[key]

    def _infer(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        slot = self._slot(feed)
        load_slot(self.ort, slot, feed)
        slot["session"].run_with_iobinding(slot["binding"])
        return dict(zip(self.output_names, slot["binding"].copy_outputs_to_cpu()))

    def prepared(self, feed: dict[str, np.ndarray]) -> tuple[Any, bool]:
        """``(call, graph)``: ``call()`` runs once on device-resident copies of ``feed`` and returns the first
        output as an ``OrtValue`` on the GPU; ``graph`` says whether it replays a CUDA graph. For benchmarks."""
        slot = self._slot(feed)
        load_slot(self.ort, slot, feed)
        binding = slot["binding"]

        def call() -> Any:
            slot["session"].run_with_iobinding(binding)
            return binding.get_outputs()[0]

        return call, slot["static"]

    def time_ms(
        self, feed: dict[str, np.ndarray], warmup: int, iterations: int, budget_s: float | None = None
    ) -> list[float]:
        """Engine time on device buffers (inputs uploaded once, outputs left on the GPU).

        ``run_with_iobinding`` returns after ORT synchronizes its stream, so CUDA events recorded around it on
        torch's stream bracket the whole GPU execution plus launch overhead (what a serving loop pays).
        """
        call, _ = self.prepared(feed)
        for _ in range(max(warmup, 3)):  # ORT captures the CUDA graph during its first runs
            call()
        return time_calls(call, iterations, budget_s=budget_s)

    def _deactivate(self) -> None:
        self.slots.clear()
        self.models.clear()
        del self.session


def pin_shapes(model: onnx.ModelProto, shapes: dict[str, tuple[int, ...]]) -> onnx.ModelProto:
    """A copy of ``model`` whose inputs have these fixed shapes (ORT then folds the shape arithmetic).

    Only symbolic axes are pinned: overwriting an axis the model fixed (an engine built for batch 1 asked for 32)
    would make a graph that claims one shape and computes another, which a timing would then mislabel. Such a
    request is a :class:`BuildError`, as ORT itself would refuse the input."""
    fixed = copy.deepcopy(model)
    for inp in fixed.graph.input:
        if inp.name not in shapes:
            continue
        dims, want = inp.type.tensor_type.shape.dim, shapes[inp.name]
        if len(dims) != len(want):
            raise BuildError(
                f"input '{inp.name}' has rank {len(dims)}, got an array of shape {list(want)}",
                hint="feed arrays of the engine's input rank (see its kiln-engine.json)",
            )
        for axis, (dim, size) in enumerate(zip(dims, want)):
            if dim.HasField("dim_value") and dim.dim_value > 0 and dim.dim_value != size:
                raise BuildError(
                    f"input '{inp.name}' axis {axis} is fixed to {dim.dim_value} in the engine, got {size}",
                    hint="feed the shape the engine was built for, or rebuild it with a dynamic axis",
                )
            dim.Clear()
            dim.dim_value = int(size)
    return fixed
