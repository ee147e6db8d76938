"""Triton model repositories for Kiln engines: the stock backends' configs, checked against the engine, and a
Python-backend model that serves any engine :func:`load_engine` opens.

Stock layout: ``<model>/config.pbtxt`` + ``<model>/1/model.{onnx,plan}`` (``onnxruntime_onnx`` / ``tensorrt_plan``).
Those backends cannot express every Kiln engine: a TensorRT-RTX engine, or an ONNX Runtime engine whose settings
Kiln autotuned (IO binding, CUDA graphs, per-batch settings). The Python-backend layout
``<model>/config.pbtxt`` (``backend: "python"``) + ``<model>/1/model.py`` + ``<model>/1/engine/`` runs the engine
exactly as Kiln validated it.

A config is first built as a dict, checked against the engine's ``kiln-engine.json`` (batch, dims, dtypes,
batcher, instance kind), then rendered: a config that disagrees with its engine fails when it is written, not
when Triton loads it (or, worse, when a request of the wrong shape arrives).
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

from kiln.core.artifacts import write_text_atomic
from kiln.core.errors import ModelError
from kiln.core.records import EngineMetadata, TensorSpec
from kiln.stages.engines.backend import TritonModel
from kiln.stages.engines.registry import BACKENDS

log = logging.getLogger("kiln.package")

TRITON_TYPES = {
    "float32": "TYPE_FP32",
    "float16": "TYPE_FP16",
    "int64": "TYPE_INT64",
    "int32": "TYPE_INT32",
    "int8": "TYPE_INT8",
    "uint8": "TYPE_UINT8",
    "bool": "TYPE_BOOL",
    "float64": "TYPE_FP64",
}
ENGINE_SUBDIR = "engine"
# Protobuf text format's string escapes (as google.protobuf.text_encoding writes them): the quote and the backslash
# must be escaped, other control characters are written as octal bytes; non-ASCII stays UTF-8, which Triton's
# (C++) and protobuf's Python parsers both read.
_PBTXT_ESCAPES = {
    **{i: f"\\{i:03o}" for i in [*range(32), 127]},
    **{ord("\t"): "\\t", ord("\n"): "\\n", ord("\r"): "\\r", ord('"'): '\\"', ord("\\"): "\\\\"},
}


def _dynamic(dim: Any) -> bool:
    return not (isinstance(dim, int) and dim > 0)


def engine_max_batch(meta: EngineMetadata) -> int | None:
    """The largest batch the engine is served with: what its profiles take (a TensorRT engine's bound it) and the
    largest batch it was validated at, the smaller (None: neither bounds it)."""
    return meta.max_batch()


def first_axes(meta: EngineMetadata) -> list[str]:
    """The names the inputs' dynamic first axes carry, each once, in input order: one for a model whose inputs come
    in one batch, several for one that takes them in counts of their own (a two-tower model's ``texts`` and
    ``images``: axes are tied by the graph's names only). A fixed first axis is no batch: :func:`batchable`."""
    return list(dict.fromkeys(s.shape[0] for s in meta.inputs if s.shape and isinstance(s.shape[0], str)))


def batchable(meta: EngineMetadata) -> bool:
    """Whether Triton may batch requests: every input and output has a dynamic first axis and another axis after
    it, the inputs' first axes are one batch axis (:func:`first_axes`), and validation found every output's rows
    to be the samples. A model exported with a fixed batch (say 1), or with an output whose length the values
    decide (torch.nonzero's ``[u0, 2]``, a detector's boxes after NMS), mixes the batch's rows (CLIP's
    ``[images, texts]``) or has no batch axis, is served with ``max_batch_size: 0`` and its full shapes as dims: a
    batch of requests could not be split back. So is one whose inputs come in counts of their own (``texts`` and
    ``images``): Triton's batcher takes one batch size per request and would refuse 5 texts with 2 images. So is
    one with a tensor of the batch axis alone (``[batch]``: a regression's squeezed output, an argmax, a per-sample
    scalar input): Triton takes no empty ``dims`` and would have clients send ``[batch, 1]`` through a
    ``reshape``, where Kiln's clients and the engine's own signature send ``[batch]``."""
    if meta.unbatched_outputs or len(first_axes(meta)) > 1:
        return False
    return all(len(s.shape) >= 2 and _dynamic(s.shape[0]) for s in meta.inputs + meta.outputs)


def _unbatchable(meta: EngineMetadata) -> str:
    """Why :func:`batchable` is false for ``meta``, in a few words."""
    if meta.unbatched_outputs:
        return f"outputs {meta.unbatched_outputs} are not the samples' rows"
    if len(first_axes(meta)) > 1:
        return f"its inputs' first axes are {first_axes(meta)}, not one batch axis"
    return "a tensor without a dynamic first axis and an axis after it"


def unbatchable_reason(meta: EngineMetadata) -> str | None:
    """Why Triton may not batch requests to ``meta``'s engine (:func:`batchable`), for a server to say; None where
    it may. Where the only cause is tensors of the batch axis alone (``[batch]``), they are named with what would
    batch them: a ``[batch, 1]`` tensor, which Triton declares as dims ``[1]``."""
    if batchable(meta):
        return None
    tensors = [("input", s) for s in meta.inputs] + [("output", s) for s in meta.outputs]
    blocking = [(kind, s) for kind, s in tensors if not (len(s.shape) >= 2 and _dynamic(s.shape[0]))]
    alone = [
        f"{kind} '{s.name}' is [{s.shape[0]}]" for kind, s in blocking if len(s.shape) == 1 and _dynamic(s.shape[0])
    ]
    if meta.unbatched_outputs or len(first_axes(meta)) > 1 or len(alone) < len(blocking):
        return _unbatchable(meta)
    return (
        f"{', '.join(alone)}, the batch axis alone, which Triton batches only as dims [1] reshaped to [], its "
        "clients then sending [batch, 1] where the engine's signature takes [batch]; exported as [batch, 1] "
        "instead, it would be batched"
    )


def served_max_batch(meta: EngineMetadata, requested: int) -> int:
    """``requested`` capped by what the engine takes and was validated for (0 = no batching): a server never forms
    a batch larger than validation compared with the reference."""
    if requested <= 0 or not batchable(meta):
        return 0
    limit = engine_max_batch(meta)
    return min(requested, limit) if limit is not None else requested


def _tensors(specs: list[TensorSpec], batched: bool) -> list[dict[str, Any]]:
    out = []
    for s in specs:
        if s.dtype not in TRITON_TYPES:
            raise ModelError(
                f"tensor '{s.name}' has dtype {s.dtype}, which Kiln cannot declare to Triton",
                hint=f"export the model with one of {sorted(TRITON_TYPES)} at its inputs and outputs",
            )
        out.append({"name": s.name, "data_type": TRITON_TYPES[s.dtype], "dims": _dims(s, batched)})
    return out


def _dims(spec: TensorSpec, batched: bool) -> list[int]:
    """A tensor's ``dims`` as Triton is told them: ``-1`` for a dynamic axis, the batch axis left out where
    ``batched``. A 0-d tensor (a model's scalar loss or score) is declared ``dims: [ 1 ]``: Triton takes no empty
    ``dims``, and refuses the ``reshape: { shape: [ ] }`` its docs give for a scalar in a model without batching
    (``scalar tensors are not supported``), the only kind that holds one (:func:`batchable`). Clients send and
    receive it as ``[1]``; Kiln's Python-backend model turns it into the engine's ``[]`` and back
    (:data:`MODEL_PY`); a stock backend cannot (:func:`scalar_tensors`)."""
    shape = spec.shape[1:] if batched else spec.shape
    return [-1 if _dynamic(d) else d for d in shape] if shape else [1]


def scalar_tensors(meta: EngineMetadata) -> list[str]:
    """The engine's 0-d inputs and outputs: Triton's stock backends would have to declare them ``[1]`` where the
    graph has ``[]``, which they refuse, so only the Python-backend model serves such an engine."""
    return [s.name for s in meta.inputs + meta.outputs if not s.shape]


def stock_model(meta: EngineMetadata) -> TritonModel | None:
    """How Triton's stock backend loads this engine (the backend's registration says), or None where it cannot."""
    return BACKENDS[meta.backend].stock_triton(meta) if meta.backend in BACKENDS else None


def _stock(meta: EngineMetadata) -> TritonModel:
    stock = stock_model(meta)
    if stock is None:
        raise ModelError(f"engine {meta.name} has no stock Triton backend", hint="serve it from triton-python/")
    return stock


def model_config(
    model_name: str,
    meta: EngineMetadata,
    max_batch_size: int,
    backend: str | None = None,
    queue_delay_us: int = 100,
    gpus: list[int] | None = None,
    instances: int = 1,
) -> dict[str, Any]:
    """The config as a dict. ``backend="python"`` for the Python-backend model, else the engine's stock platform.
    ``gpus``: ``instances`` model instances on each of these GPUs (Triton's ``instance_group.gpus``), for a CUDA
    engine; without it one instance on the engine's device kind, wherever Triton places it."""
    mbs = served_max_batch(meta, max_batch_size)
    cfg: dict[str, Any] = {"name": model_name}
    if backend is not None:
        cfg["backend"] = backend
    else:
        cfg["platform"] = _stock(meta).platform
    cfg["max_batch_size"] = mbs
    cfg["input"] = _tensors(meta.inputs, mbs > 0)
    cfg["output"] = _tensors(meta.outputs, mbs > 0)
    cfg["instance_group"] = [instance_group(meta, gpus, instances)]
    if mbs > 0:
        cfg["dynamic_batching"] = {"max_queue_delay_microseconds": queue_delay_us}
    check_config(cfg, meta)
    return cfg


def instance_group(meta: EngineMetadata, gpus: list[int] | None, instances: int = 1) -> dict[str, Any]:
    """Where Triton runs the model's instances: ``instances`` per GPU listed in ``gpus``, else one on the engine's
    device kind. Requests to the model are spread over every instance: one endpoint for all of a host's GPUs."""
    group: dict[str, Any] = {"kind": "KIND_GPU" if meta.device == "cuda" else "KIND_CPU", "count": instances}
    if gpus is not None:
        group["gpus"] = list(gpus)
    return group


def check_config(cfg: dict[str, Any], meta: EngineMetadata) -> None:
    """Raise :class:`ModelError` where a config disagrees with the engine it serves."""
    problems = []
    mbs = cfg["max_batch_size"]
    stock = stock_model(meta)
    if "platform" in cfg and (stock is None or cfg["platform"] != stock.platform):
        problems.append(f"platform {cfg['platform']} cannot run a {meta.backend} engine")
    if mbs > 0 and not batchable(meta):
        problems.append(f"max_batch_size {mbs} but the engine takes no batch of requests ({_unbatchable(meta)})")
    problems += _batch_limit_problems(mbs, meta)
    if mbs > 0 and meta.batch_range and meta.batch_range[0] > 1:
        problems.append(f"the engine takes batches from {meta.batch_range[0]}: a single request would fail")
    if (mbs > 0) != ("dynamic_batching" in cfg):
        problems.append("dynamic_batching must be set exactly when max_batch_size > 0")
    for kind in ("input", "output"):
        specs = meta.inputs if kind == "input" else meta.outputs
        if [t["name"] for t in cfg[kind]] != [s.name for s in specs]:
            problems.append(f"{kind} names {[t['name'] for t in cfg[kind]]} != engine's {[s.name for s in specs]}")
            continue
        for t, s in zip(cfg[kind], specs):
            if t["data_type"] != TRITON_TYPES.get(s.dtype):
                problems.append(f"{kind} '{s.name}': {t['data_type']} but the engine takes {s.dtype}")
            if t["dims"] != _dims(s, mbs > 0):
                problems.append(
                    f"{kind} '{s.name}': dims {t['dims']} do not match the engine's {s.shape}"
                    f"{' less its batch axis' if mbs > 0 else ''}"
                )
    want_kind = "KIND_GPU" if meta.device == "cuda" else "KIND_CPU"
    if any(g["kind"] != want_kind or g["count"] < 1 for g in cfg["instance_group"]):
        problems.append(f"instance_group {cfg['instance_group']} for a {meta.device} engine (want {want_kind})")
    for g in cfg["instance_group"]:
        if "gpus" in g and (want_kind != "KIND_GPU" or not g["gpus"] or len(set(g["gpus"])) < len(g["gpus"])):
            problems.append(f"GPUs {g['gpus']} for a {meta.device} engine (want distinct GPU ids, CUDA engines only)")
    if problems:
        raise ModelError(
            f"Triton config for {cfg['name']} disagrees with engine {meta.name}: {'; '.join(problems)}",
            hint="rebuild the engine (its kiln-engine.json may be stale), change package.max_batch_size, or "
            "validate the engine at larger batches (signature.batch_sizes)",
        )


def _batch_limit_problems(mbs: int, meta: EngineMetadata) -> list[str]:
    """Where a config's ``max_batch_size`` is past what the engine's profiles take or what it was validated at."""
    profile = meta.batch_range[1] if meta.batch_range else None
    validated = meta.validated_max_batch()
    problems = []
    if mbs > 0 and profile is not None and mbs > profile:
        problems.append(f"max_batch_size {mbs} exceeds the engine's profile maximum {profile}")
    if mbs > 0 and validated is not None and mbs > validated:
        problems.append(f"max_batch_size {mbs} exceeds the largest batch the engine was validated at ({validated})")
    return problems


def _quoted(text: str) -> str:
    """``text`` as a protobuf text-format string literal: a tensor name may hold quotes, backslashes or newlines."""
    return '"' + text.translate(_PBTXT_ESCAPES) + '"'


def render_pbtxt(cfg: dict[str, Any]) -> str:
    """Protobuf text format. Written by hand: the ModelConfig protobuf ships with tritonclient, an optional extra,
    and packaging must work without it (the tests parse this text with that protobuf)."""
    lines = [f"name: {_quoted(cfg['name'])}"]
    lines += [f"{key}: {_quoted(cfg[key])}" for key in ("platform", "backend") if key in cfg]
    lines.append(f"max_batch_size: {cfg['max_batch_size']}")
    for kind in ("input", "output"):
        items = [
            f"  {{\n    name: {_quoted(t['name'])}\n    data_type: {t['data_type']}\n"
            f"    dims: [ {', '.join(map(str, t['dims']))} ]\n  }}"
            for t in cfg[kind]
        ]
        lines.append(f"{kind} [\n" + ",\n".join(items) + "\n]")
    groups = ", ".join(
        f"{{ kind: {g['kind']} count: {g['count']}"
        + (f" gpus: [ {', '.join(map(str, g['gpus']))} ]" if "gpus" in g else "")
        + " }"
        for g in cfg["instance_group"]
    )
    lines.append(f"instance_group [ {groups} ]")
    if "dynamic_batching" in cfg:
        lines.append(
            f"dynamic_batching {{ max_queue_delay_microseconds: "
            f"{cfg['dynamic_batching']['max_queue_delay_microseconds']} }}"
        )
    return "\n".join(lines) + "\n"


def triton_config(model_name: str, meta: EngineMetadata, max_batch_size: int) -> str:
    """The stock backend's ``config.pbtxt`` for an engine, checked against its metadata."""
    return render_pbtxt(model_config(model_name, meta, max_batch_size))


def write_stock_model(target: Path, engine_dir: Path, meta: EngineMetadata, max_batch_size: int) -> None:
    """``<target>/config.pbtxt`` + ``1/model.{onnx,plan}``: the stock backend's model, for an engine without 0-d
    tensors (:func:`scalar_tensors`: the package stage leaves such an engine to ``triton-python/``)."""
    if scalar_tensors(meta):
        raise ModelError(
            f"engine {meta.name} has the 0-d tensors {scalar_tensors(meta)}, which stock Triton backends cannot serve",
            hint="serve it from triton-python/ (`kiln serve`), or return them with a batch axis",
        )
    (target / "1").mkdir(parents=True)
    _link_or_copy(engine_dir / meta.files["model"], target / "1" / _stock(meta).model_file)
    write_text_atomic(target / "config.pbtxt", triton_config(target.name, meta, max_batch_size))
    _say_uncapped(target.name, meta, max_batch_size)


def _say_uncapped(model_name: str, meta: EngineMetadata, max_batch_size: int) -> None:
    """Warn where ``package.max_batch_size: 0`` leaves the stock model's first axis free (dims ``-1``): Triton's
    stock backends check no row count of an unbatched model, so it takes batches past the validated one, which the
    Python-backend model and the Ray app refuse."""
    validated = meta.validated_max_batch()
    free_rows = any(s.shape and _dynamic(s.shape[0]) for s in meta.inputs)
    if max_batch_size <= 0 and batchable(meta) and validated is not None and free_rows:
        log.warning(
            "%s: package.max_batch_size: 0 serves the stock Triton repository (triton/) unbatched: Triton takes a "
            "request of any number of rows there, past the validated batch %d (triton-python/ and the Ray app "
            "refuse more); to cap it, set package.max_batch_size to %d",
            model_name,
            validated,
            validated,
        )


# The Python backend's model: Triton hands it a list of requests (one per client call, each with its own batch
# axis); it concatenates them, runs the engine once, and splits the outputs back. Written as a file because
# Triton imports it by path; it needs `kiln` importable in the interpreter that runs Triton's Python stub.
MODEL_PY = '''"""Triton Python-backend model written by Kiln: serves the Kiln engine in ./engine (kiln.load_engine)."""
import gc
import json
import os
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from kiln import load_engine
from kiln.serve.batching import batched_infer, buckets_for, request_fault, warm_buckets
from kiln.serve.stub_times import StubStamps, StubTimes, sent_times
from kiln.serve.stub_parent import exit_with_server


def _error(message, invalid):
    """Triton's error for a response: INVALID_ARG (HTTP 400) for the request's own fault, where the stub has codes."""
    code = getattr(pb_utils.TritonError, "INVALID_ARG", None) if invalid else None
    return pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)


class TritonPythonModel:
    def initialize(self, args):
        exit_with_server()  # a server killed outright leaves its stubs: this one ends itself (kiln.serve.stub_parent)
        if args.get("model_instance_kind") == "GPU":
            # Each instance is its own stub process: pinned to its GPU before the engine first touches CUDA, the
            # engine's device 0 is that GPU (instance_group.gpus spreads instances over the host's GPUs).
            os.environ["CUDA_VISIBLE_DEVICES"] = str(args["model_instance_device_id"])
        engine_dir = Path(args["model_repository"]) / args["model_version"] / "engine"
        self.runner = load_engine(engine_dir, serving=True).activate()
        config = json.loads(args["model_config"])
        self.batched = config["max_batch_size"] > 0
        # an engine that builds per input shape runs padded batches of a few sizes, each built before Triton says
        # ready (kiln.serve.batching)
        self.buckets = buckets_for(self.runner, config["max_batch_size"])
        if self.buckets:
            warm_buckets(self.runner, self.runner.meta, self.buckets)
        self.inputs = [t["name"] for t in config["input"]]
        self.outputs = {t["name"]: pb_utils.triton_string_to_numpy(t["data_type"]) for t in config["output"]}
        # a 0-d tensor is declared dims [1] (Triton takes no empty dims): the engine's [] sent as [1], and back
        self.scalars = {s.name for s in self.runner.meta.inputs + self.runner.meta.outputs if not s.shape}
        # the phases of every execution, as Triton custom metrics (kiln.serve.stub_times); a Triton without custom
        # metrics (an older one, or metrics turned off) serves the model without them
        try:
            self.times = StubTimes(args["model_name"], pb_utils)
        except Exception:
            self.times = None
        self.stamps = StubStamps.from_env()  # a diagnosis asked for by KILN_STUB_STAMPS (kiln.serve.stub_times)
        # what exists now lives as long as the process: out of the collector's sight, so that no full collection
        # (a pass over every object torch and the engine created, a fraction of a second) stalls a request
        gc.freeze()

    def execute(self, requests):
        start, start_ns = time.perf_counter(), time.monotonic_ns()
        feeds = [{n: self._input(r, n) for n in self.inputs} for r in requests]
        # a request outside the sizes the engine was validated for (or empty: 0 rows abort ONNX Runtime's LSTM/GRU
        # kernels and this stub; or holding an index past its table) is answered with an error naming them
        refused = [self.runner.meta.refusal(f) for f in feeds]
        todo = [i for i, why in enumerate(refused) if why is None]
        refused = [(why, True) for why in refused]  # (message, the request's own fault: an HTTP 400)
        answers = {}
        read = time.perf_counter()
        try:
            answers = dict(zip(todo, self._run([feeds[i] for i in todo]))) if todo else {}
        except Exception as exc:  # the engine failed on this batch: each request alone, the server goes on
            answers, refused = self._alone(feeds, todo, refused, exc)
        ran = time.perf_counter()
        responses = [
            pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor(n, self._output(answers[i][n], n, t)) for n, t in self.outputs.items()])
            if i in answers else pb_utils.InferenceResponse(error=_error(*refused[i]))
            for i in range(len(requests))
        ]
        sent = []
        if self.stamps is not None:  # the diagnosis only: every request's parameters read
            try:
                sent = sent_times(requests)
                self.stamps.add(sent, start_ns, time.monotonic_ns())
            except Exception:  # a Python backend whose requests have no parameters(): no send times to read
                self.stamps = None
        if self.times is not None:
            try:
                waited = [(start_ns - s) / 1e9 for s in sent]  # of the requests that carry their send time
                self.times.add(len(requests), read - start, ran - read, time.perf_counter() - ran, waited)
            except Exception:  # Triton refused a metric update: the answers go out, without timings from now on
                self.times = None
        return responses

    def _input(self, request, name):
        array = pb_utils.get_input_tensor_by_name(request, name).as_numpy()
        return array.reshape(()) if name in self.scalars and array.size == 1 else array

    def _output(self, array, name, dtype):
        array = np.ascontiguousarray(array, dtype=dtype)
        return array.reshape(1) if name in self.scalars else array

    def _alone(self, feeds, todo, refused, exc):
        """The batch failed: each of its requests alone, so that the one the engine refuses (a token id past the
        vocabulary) gets the error and the others their answers."""
        answers, refused, failed = {}, list(refused), []
        for i in todo:
            try:
                if len(todo) == 1:
                    raise exc  # it ran alone already
                answers[i] = self._run([feeds[i]])[0]
            except Exception as one:
                failed.append((i, f"the engine failed on this request: {type(one).__name__}: {one}", one))
        for i, why, one in failed:  # the request's own fault where the engine answered others, or said so
            refused[i] = (why, bool(answers) or request_fault(one))
        return answers, refused

    def _run(self, feeds):
        if not self.batched:
            return [self.runner.infer(f) for f in feeds]
        return batched_infer(self.runner, feeds, self.buckets)

    def finalize(self):
        if self.stamps is not None:  # first: a stub still unloading when Triton's exit timeout ends is killed
            self.stamps.write()
        if self.times is not None:
            self.times.close()
        self.runner.deactivate()
'''


def write_python_model(
    target: Path,
    engine_dir: Path,
    meta: EngineMetadata,
    max_batch_size: int,
    gpus: list[int] | None = None,
    instances: int = 1,
    queue_delay_us: int = 100,
) -> None:
    """``<target>/config.pbtxt`` + ``1/model.py`` + ``1/engine/``; ``gpus``/``instances`` as in :func:`model_config`."""
    version = target / "1"
    version.mkdir(parents=True)
    shutil.copytree(engine_dir, version / ENGINE_SUBDIR, copy_function=_link_or_copy)
    write_text_atomic(version / "model.py", MODEL_PY)
    cfg = model_config(target.name, meta, max_batch_size, "python", queue_delay_us, gpus, instances)
    write_text_atomic(target / "config.pbtxt", render_pbtxt(cfg))


def _link_or_copy(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    """A hard link where the file system allows it: the package holds each engine once on disk, not once per
    repository layout."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
