"""A Ray Serve application for one Kiln engine: what ``package/ray/serve.yaml`` starts (from the package folder:
``serve run ray/serve.yaml``), on one machine or a Ray cluster, one application (one deployment) per engine.

The deployment speaks the KServe v2 inference protocol over HTTP as Triton's HTTP endpoint does, its binary tensor
data extension included: ``POST /v2/models/<model>/infer`` with ``{"inputs": [{"name", "shape", "datatype",
"data"}]}`` (or an input's ``parameters.binary_data_size`` and its bytes after the JSON, whose length the
``Inference-Header-Content-Length`` header gives) answers ``{"outputs": [...]}``: the outputs the request's
``outputs`` names (all when it names none), as JSON data or, where asked (``binary_data``, ``binary_data_output``),
as bytes after the JSON. ``GET /v2/models/<model>/ready`` says whether the replica can answer. ``tritonclient.http``
(its defaults: binary tensors) and ``kiln loadtest ray://...`` talk to it. Requests are checked against the
engine's metadata before they are queued (names, dtypes, shapes, JSON values of the dtype's type, never cast, the
batch limit: no more rows than the engine was validated for, the outputs asked for): a bad request is a 400 naming
the problem, and never reaches the batch of others. Requests are batched with ``@serve.batch`` up to
``max_batch_size`` rows, at most the largest batch the engine was validated at; an unbatched engine's (Triton's
``max_batch_size: 0``: clients send whole batches) run whole, one engine call each. A batch the engine raises on
runs again a request at a time, so that a request it refuses (a token id past the vocabulary) fails alone,
answered 400 while the engine still answers others. A replica whose engine failed (it no longer answers the last
request it answered) fails its health check, logged with the reason; Ray then replaces it, which its controller
logs too: nothing restarts silently.

Needs ``ray[serve]`` (``pip install "kiln[ray]"``), imported here: the package stage writes the config without it.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import math
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np
from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kiln.core.errors import InputFileError
from kiln.core.records import EngineMetadata, TensorSpec
from kiln.stages.engines.backend import SIDECAR, read_metadata
from kiln.stages.engines.registry import load_engine
from kiln.stages.package.rayserve import HEALTH_APP
from kiln.stages.package.triton import TRITON_TYPES, served_max_batch

log = logging.getLogger("ray.serve")
# KServe v2 datatypes by numpy dtype name (Triton's names without TYPE_)
V2_TYPES = {dtype: name.removeprefix("TYPE_") for dtype, name in TRITON_TYPES.items()}
V2_DTYPES = {name: dtype for dtype, name in V2_TYPES.items()}
# The binary tensor extension's header: the length of the JSON that binary tensor data follows
HEADER_LENGTH = "Inference-Header-Content-Length"
# The Python types of the JSON values each numpy dtype kind takes, the commonest first (bool is no integer here, as
# in Triton), and what to call them
JSON_KINDS = {"i": (int,), "u": (int,), "f": (float, int), "b": (bool,)}
JSON_TAKES = {"i": "JSON integers", "u": "JSON integers", "f": "JSON numbers", "b": "true or false"}


class BadRequest(ValueError):
    """A request the engine cannot take; the message names the problem."""


def read_request(
    raw: bytes, header_length: str | None, meta: EngineMetadata, max_rows: int
) -> tuple[dict[str, np.ndarray], dict[str, bool]]:
    """An HTTP request body as the engine's feed and the outputs it asks for (:func:`requested_outputs`), or
    :class:`BadRequest` saying what is wrong with it. ``header_length`` is the ``Inference-Header-Content-Length``
    header, present when binary tensor data follows the JSON."""
    body, binary = split_body(raw, header_length)
    return parse_request(body, meta, max_rows, binary), requested_outputs(body, meta)


def split_body(raw: bytes, header_length: str | None) -> tuple[Any, memoryview]:
    """The JSON of a request body and the binary tensor data after it (KServe v2's binary tensor extension, as
    ``tritonclient.http`` sends by default): the first ``header_length`` bytes are JSON, the rest tensor data; without
    the header the whole body is JSON."""
    size = len(raw)
    if header_length is not None:
        size = int(header_length) if header_length.strip().isdecimal() else -1
        if not 0 <= size <= len(raw):
            raise BadRequest(f"{HEADER_LENGTH} {header_length!r} is not a length within the body's {len(raw)} bytes")
    try:
        return json.loads(raw[:size]), memoryview(raw)[size:]
    except ValueError:  # UnicodeDecodeError among them
        if header_length is not None:
            raise BadRequest(f"the body's first {size} bytes ({HEADER_LENGTH}) are not JSON") from None
        raise BadRequest(
            f"the body is not JSON: binary tensor data after the JSON needs the {HEADER_LENGTH} header giving the "
            "JSON's length (KServe v2's binary tensor extension), or send JSON data (tritonclient.http: "
            "set_data_from_numpy(array, binary_data=False))"
        ) from None


def parse_request(
    body: Any, meta: EngineMetadata, max_rows: int, binary: bytes | memoryview = b""
) -> dict[str, np.ndarray]:
    """A v2 request's JSON (and the binary tensor data after it) as the engine's feed, or :class:`BadRequest` saying
    what is wrong with it."""
    if not isinstance(body, dict) or not isinstance(body.get("inputs"), list):
        raise BadRequest('the body must be a JSON object with an "inputs" list (KServe v2 protocol)')
    if not all(isinstance(t, dict) and type(t.get("name")) is str for t in body["inputs"]):
        raise BadRequest('each of "inputs" must be a JSON object with a "name" (KServe v2 protocol)')
    names = [t["name"] for t in body["inputs"]]
    if twice := sorted({n for n in names if names.count(n) > 1}):
        raise BadRequest(f"inputs {twice} given more than once")
    given = {t["name"]: t for t in body["inputs"]}
    want = [s.name for s in meta.inputs]
    if sorted(given) != sorted(want):
        raise BadRequest(f"inputs {sorted(given)} given; the model takes {want}")
    parts = _binary_parts(body["inputs"], memoryview(binary))
    feed = {s.name: _tensor(given[s.name], s.name, s.dtype, parts.get(s.name)) for s in meta.inputs}
    for spec in meta.inputs:  # before the ranges, which name axes by position: a wrong rank is said as such
        wrong = _misshapen(spec, feed[spec.name].shape)
        if wrong is not None:
            raise BadRequest(wrong)
    outside = meta.refusal(feed)
    if outside is not None:
        raise BadRequest(outside)
    if not max_rows:  # run whole: inputs in counts of their own (texts and images) are the engine's to check
        return feed
    rows = {len(v) for v in feed.values()}  # joined with other requests and split back by rows: one batch
    if len(rows) > 1:
        raise BadRequest(f"inputs have different batch sizes {sorted(rows)}")
    if rows.pop() > max_rows:
        raise BadRequest(f"a batch of {len(feed[want[0]])} rows is over this server's limit of {max_rows}")
    return feed


def requested_outputs(body: dict[str, Any], meta: EngineMetadata) -> dict[str, bool]:
    """The outputs a request asks for (all the model's when it names none), each with whether it is answered as
    binary data: its own ``binary_data`` parameter, else the request's ``binary_data_output`` (the binary tensor
    extension's rule)."""
    default = _flag(_parameters(body, "the request"), "binary_data_output", "the request", False)
    asked = body.get("outputs") or []
    if not isinstance(asked, list) or not all(isinstance(o, dict) for o in asked):
        raise BadRequest('"outputs" must be a list of objects with a "name" (KServe v2 protocol)')
    have = [s.name for s in meta.outputs]
    names = [o.get("name") for o in asked]
    if unknown := [n for n in names if n not in have]:
        raise BadRequest(f"output {unknown[0]!r} is not one of the model's outputs {have}")
    if twice := sorted({n for n in names if names.count(n) > 1}):
        raise BadRequest(f"outputs {twice} asked for more than once")
    wanted = dict.fromkeys(have if not asked else [], default)
    for out in asked:
        what = f"output '{out['name']}'"
        params = _tensor_parameters(out, what)
        if "classification" in params:
            raise BadRequest(f"{what} asks for classification (Triton's extension), which this server does not do")
        wanted[out["name"]] = _flag(params, "binary_data", what, default)
    return wanted


def _parameters(obj: dict[str, Any], what: str) -> dict[str, Any]:
    params = obj.get("parameters", {})
    if not isinstance(params, dict):
        raise BadRequest(f'{what}: "parameters" must be a JSON object, not {params!r}')
    return params


def _tensor_parameters(t: dict[str, Any], what: str) -> dict[str, Any]:
    """A tensor's parameters; one in shared memory (Triton's extension) is refused, its data not being here."""
    params = _parameters(t, what)
    if "shared_memory_region" in params:
        raise BadRequest(f"{what} is in shared memory, which this server does not read: send it in the body")
    return params


def _flag(params: dict[str, Any], key: str, what: str, default: bool) -> bool:
    value = params.get(key, default)
    if type(value) is not bool:
        raise BadRequest(f"{what}: parameter {key} must be true or false, not {value!r}")
    return value


def _binary_parts(inputs: list[dict[str, Any]], binary: memoryview) -> dict[str, memoryview]:
    """Each binary input's bytes (``parameters.binary_data_size``), cut from the tensor data after the JSON in the
    order the request lists its inputs; bytes no input claims are refused, as Triton refuses them."""
    parts: dict[str, memoryview] = {}
    start = 0
    for t in inputs:
        what = f"input '{t['name']}'"
        size = _tensor_parameters(t, what).get("binary_data_size")
        if size is None:
            continue
        if type(size) is not int or size < 0:
            raise BadRequest(f"{what}: binary_data_size must be a number of bytes, not {size!r}")
        if "data" in t:
            raise BadRequest(f'{what} has both "data" and binary_data_size: send one')
        if start + size > len(binary):
            raise BadRequest(
                f"{what}: binary_data_size {size} from byte {start} runs past the {len(binary)} bytes of tensor data "
                f"after the JSON ({HEADER_LENGTH} gives the JSON's length)"
            )
        parts[t["name"]] = binary[start : start + size]
        start += size
    if start != len(binary):
        raise BadRequest(
            f"{len(binary) - start} bytes of tensor data after the JSON belong to no input's binary_data_size"
        )
    return parts


def _misshapen(spec: TensorSpec, shape: tuple[int, ...]) -> str | None:
    """Why an array of ``shape`` is not what ``spec`` takes: its rank, or a fixed size past the batch axis; None
    when it fits."""
    dims = "[" + ", ".join(map(str, spec.shape)) + "]"
    if len(shape) != len(spec.shape):
        return f"input '{spec.name}' has {len(shape)} axes {list(shape)}; the model takes {len(spec.shape)}: {dims}"
    if any(isinstance(d, int) and d > 0 and i > 0 and shape[i] != d for i, d in enumerate(spec.shape)):
        return f"input '{spec.name}' has shape {list(shape)}; the model takes {dims}"
    return None


def _tensor(t: dict[str, Any], name: str, dtype: str, raw: memoryview | None) -> np.ndarray:
    """An input as an array: from its bytes where it came as binary data, else from its JSON ``data``."""
    if t.get("datatype") != V2_TYPES[dtype]:
        raise BadRequest(f"input '{name}' is {t.get('datatype')}; the model takes {V2_TYPES[dtype]}")
    shape = t.get("shape")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):  # true is no size
        raise BadRequest(f"input '{name}': shape must be a list of sizes, not {shape!r}")
    if raw is not None:
        return _from_binary(raw, name, dtype, shape)
    return _from_json(t.get("data"), name, dtype, shape)


def _from_binary(raw: memoryview, name: str, dtype: str, shape: list[int]) -> np.ndarray:
    """Binary tensor data: little-endian, row-major; copied, so that the engine gets a writable array."""
    size = math.prod(shape) * np.dtype(dtype).itemsize
    if len(raw) != size:
        raise BadRequest(
            f"input '{name}' has {len(raw)} bytes of binary data; shape {shape} of {V2_TYPES[dtype]} takes {size}"
        )
    return np.frombuffer(raw, np.dtype(dtype).newbyteorder("<")).astype(dtype).reshape(shape)


def _from_json(data: Any, name: str, dtype: str, shape: list[int]) -> np.ndarray:
    """JSON values (a flat list, or nested lists read row-major) of the types ``dtype`` takes, as Triton's front end
    takes them: integers for integer types (not true, not 1.0), numbers for floats (not null, not strings), true
    and false for BOOL; anything else is refused, never cast. The values' types are counted in C (``list.count``
    over ``map(type, ...)``, no Python loop per value), then numpy converts them."""
    if not isinstance(data, list):
        raise BadRequest(f"input '{name}' has no data list (nor a binary_data_size for binary data after the JSON)")
    flat = _flatten(data)
    kind = np.dtype(dtype).kind
    allowed = JSON_KINDS[kind]
    types = list(map(type, flat))
    if types.count(allowed[0]) != len(types) and sum(map(types.count, allowed)) != len(types):
        at = next(i for i, t in enumerate(types) if t not in allowed)
        shown = json.dumps(flat[at])[:60]
        raise BadRequest(f"input '{name}' is {V2_TYPES[dtype]}, which takes {JSON_TAKES[kind]}: value {at} is {shown}")
    if len(flat) != math.prod(shape):
        raise BadRequest(f"input '{name}' has {len(flat)} values; shape {shape} takes {math.prod(shape)}")
    if kind in "iu":
        return _integers(flat, name, dtype).reshape(shape)
    try:
        return np.fromiter(flat, dtype, len(flat)).reshape(shape)
    except OverflowError:  # an integer past any float
        at = next(i for i, v in enumerate(flat) if not _is_float(v))
        raise BadRequest(f"input '{name}' is {V2_TYPES[dtype]}: value {at} is past any float") from None


def _is_float(value: float) -> bool:
    try:
        float(value)
    except OverflowError:
        return False
    return True


def _flatten(data: list[Any]) -> list[Any]:
    """Nested lists (a JSON tensor written row by row) as one flat list; a flat list as it is."""
    flat = data
    while flat and type(flat[0]) is list and list(map(type, flat)).count(list) == len(flat):
        flat = list(chain.from_iterable(flat))
    return flat


def _integers(flat: list[int], name: str, dtype: str) -> np.ndarray:
    """JSON integers as ``dtype``, refused where one does not fit it (numpy would wrap it around)."""
    info = np.iinfo(dtype)
    try:
        wide = np.fromiter(flat, np.int64, len(flat))
    except OverflowError:  # past int64
        wide = None
    fits = wide is not None and (dtype == "int64" or not wide.size or info.min <= wide.min() <= wide.max() <= info.max)
    if not fits:
        at, value = next((i, v) for i, v in enumerate(flat) if not info.min <= v <= info.max)
        takes = f"integers in [{info.min}, {info.max}]"
        raise BadRequest(f"input '{name}' is {V2_TYPES[dtype]}, which takes {takes}: value {at} is {value}")
    return wide.astype(dtype, copy=False)


def _json(content: Any) -> bytes:
    """JSON whose values may be infinite or NaN (a class masked with -inf on purpose, an overflow): written as JSON's
    common extension (``Infinity``, ``NaN``), as Python's json and tritonclient read them, where starlette's strict
    JSON would fail the request with a bare 500."""
    return json.dumps(content, ensure_ascii=False, allow_nan=True, separators=(",", ":")).encode()


def v2_response(model: str, outputs: dict[str, np.ndarray], wanted: dict[str, bool]) -> Response:
    """The answer of the outputs asked for, in the order asked: each as JSON ``data``, or (binary) as its bytes after
    the JSON, whose length the ``Inference-Header-Content-Length`` header then gives."""
    tensors, chunks = [], []
    for name, binary in wanted.items():
        a = outputs[name]
        tensor: dict[str, Any] = {"name": name, "datatype": V2_TYPES[a.dtype.name], "shape": list(a.shape)}
        if binary:
            chunks.append(np.ascontiguousarray(a, a.dtype.newbyteorder("<")).tobytes())
            tensor["parameters"] = {"binary_data_size": len(chunks[-1])}
        else:
            tensor["data"] = a.ravel().tolist()
        tensors.append(tensor)
    header = _json({"model_name": model, "outputs": tensors})
    if not chunks:
        return Response(header, media_type="application/json")
    return Response(
        header + b"".join(chunks), media_type="application/octet-stream", headers={HEADER_LENGTH: str(len(header))}
    )


@serve.deployment(health_check_period_s=5, health_check_timeout_s=30)
class KilnEngine:
    """One replica: the engine opened with ``load_engine`` (its files checked), requests batched (an unbatched
    engine's run whole, one engine call each)."""

    def __init__(self, engine_dir: str, model_name: str, max_batch_size: int, batch_wait_timeout_s: float) -> None:
        folder = engine_folder(engine_dir)
        self.meta = read_metadata(folder)
        self.runner = load_engine(folder, serving=True).activate()
        self.model_name = model_name
        self.max_rows = served_max_batch(self.meta, max_batch_size)
        say_capped(model_name, max_batch_size, self.max_rows)
        self.failure: str | None = None
        self.answered: dict[str, np.ndarray] | None = None
        self.infer_batch.set_max_batch_size(max(1, self.max_rows))
        self.infer_batch.set_batch_wait_timeout_s(batch_wait_timeout_s)
        gc.freeze()  # the engine's and the libraries' objects out of the collector's sight (as the Triton stub)

    async def __call__(self, request: Request) -> Response:
        path = request.url.path.rstrip("/")
        if request.method == "GET" and path.endswith("/ready"):
            ready = self.failure is None
            return JSONResponse({"ready": ready} if ready else {"error": self.failure}, 200 if ready else 503)
        if request.method == "GET":
            return JSONResponse(self._metadata())
        if not path.endswith("/infer"):
            return JSONResponse({"error": f"no route {request.method} {path}: POST .../infer"}, 404)
        return await self._infer(request)

    async def _infer(self, request: Request) -> Response:
        raw = await request.body()
        try:
            feed, wanted = read_request(raw, request.headers.get(HEADER_LENGTH), self.meta, self.max_rows)
        except BadRequest as exc:
            return JSONResponse({"error": str(exc)}, 400)
        if self.failure is not None:
            return JSONResponse({"error": f"this replica's engine failed: {self.failure}"}, 503)
        # An unbatched engine's request is a whole batch, run alone as Triton runs it: @serve.batch, whose size
        # counts rows, would hold it to one row.
        outputs = await self.infer_batch(feed) if self.max_rows else self._attempt(feed)
        if isinstance(outputs, Exception):
            return self._failed(outputs)
        self.answered = feed  # a request the engine answers: what tells a refused request from a failed engine
        return v2_response(self.model_name, outputs, wanted)

    def _failed(self, exc: Exception) -> JSONResponse:
        """The engine raised on a request that passed the checks: the request's own fault (a token id past the
        vocabulary) when the engine still answers the last request it answered (or zeros, before any), answered
        400 and the replica serves on; else the engine's, and the replica is marked unhealthy."""
        why = f"{type(exc).__name__}: {exc}"[:500]
        try:
            self._run(self.answered if self.answered is not None else _zeros(self.meta))
        except Exception:
            self.failure = why
            log.error("model %s: engine failed, replica marked unhealthy: %s", self.model_name, why)
            return JSONResponse({"error": f"the engine failed: {why}"}, 500)
        return JSONResponse({"error": f"the engine refused this request: {why}"}, 400)

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.002, batch_size_fn=lambda feeds: sum(map(_rows, feeds)))
    async def infer_batch(self, feeds: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray] | Exception]:
        """Requests that arrived together, as one engine call, split back per request; where that call fails, each
        request alone, so that one refused request fails alone (its exception in its place)."""
        if len(feeds) > 1 and self.max_rows:
            try:
                return self._together(feeds)
            except Exception:
                pass
        return [self._attempt(f) for f in feeds]

    def _together(self, feeds: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        sizes = [_rows(f) for f in feeds]
        out = self._run({n: np.concatenate([f[n] for f in feeds]) for n in feeds[0]})
        bounds = np.cumsum(sizes)[:-1]
        parts = {n: np.split(a, bounds) for n, a in out.items()}
        return [{n: parts[n][i] for n in out} for i in range(len(feeds))]

    def _attempt(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray] | Exception:
        try:
            return self._run(feed)
        except Exception as exc:
            return exc

    def _run(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        result = self.runner.infer(feed)
        return {s.name: np.asarray(result[s.name], dtype=s.dtype) for s in self.meta.outputs}

    def _metadata(self) -> dict[str, Any]:
        """KServe v2 model metadata: sizes as integers, -1 where they vary."""

        def specs(items: list[Any]) -> list[dict[str, Any]]:
            return [
                {
                    "name": s.name,
                    "datatype": V2_TYPES[s.dtype],
                    "shape": [d if isinstance(d, int) and d > 0 else -1 for d in s.shape],
                }
                for s in items
            ]

        return {
            "name": self.model_name,
            "platform": f"kiln-{self.meta.backend}",
            "inputs": specs(self.meta.inputs),
            "outputs": specs(self.meta.outputs),
        }

    def check_health(self) -> None:
        """Ray's periodic health check: a replica whose engine failed says why, and Ray replaces it."""
        if self.failure is not None:
            raise RuntimeError(f"model {self.model_name}: engine failed: {self.failure}")


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
class ServerHealth:
    """KServe v2's server-level health routes, as Triton answers them (``tritonclient``'s ``is_server_live`` and
    ``is_server_ready``, a Kubernetes probe): ``GET /v2/health/live`` is 200 once Ray's proxy routes requests here;
    ``GET /v2/health/ready`` is 200 when every other application of this Serve instance is running, else 503 naming
    those that are not with their status. The applications are read from Serve's own status, so that one removed
    from ``serve.yaml`` is not waited for and one whose replica is being replaced is not ready."""

    async def __call__(self, request: Request) -> Response:
        path = request.url.path.rstrip("/")
        if request.method == "GET" and path.endswith("/live"):
            return Response(status_code=200)
        if request.method == "GET" and path.endswith("/ready"):
            waiting = await asyncio.to_thread(not_running)
            if not waiting:
                return Response(status_code=200)
            listed = ", ".join(f"{name} {status}" for name, status in waiting.items())
            return JSONResponse({"error": f"not ready: {listed}"}, 503)
        return JSONResponse({"error": f"no route {request.method} {path}: GET /v2/health/live or /ready"}, 404)


def not_running() -> dict[str, str]:
    """The applications of this Serve instance, other than the health routes', that are not running: their status
    by name (DEPLOYING, UNHEALTHY, DEPLOY_FAILED)."""
    apps = serve.status().applications
    return {name: str(app.status.value) for name, app in apps.items() if name != HEALTH_APP and app.status != "RUNNING"}


def build_health(args: dict[str, Any]) -> Any:
    """Ray Serve's application builder for the health routes (``import_path: kiln.serve.ray_app:build_health``)."""
    return ServerHealth.bind()


def engine_folder(engine_dir: str) -> Path:
    """The engine folder ``serve.yaml`` names: a relative path (the package stage writes ``engines/<engine>``)
    from this process's working directory, which Ray gives its processes from where ``serve run`` started a local
    cluster, or from an application's ``runtime_env.working_dir``: the package folder, wherever it was copied; an
    absolute path as it is. Where no engine is there, an error saying where Ray looked and how to start it."""
    folder = Path(engine_dir) if Path(engine_dir).is_absolute() else Path.cwd() / engine_dir
    if not (folder / SIDECAR).is_file():
        raise InputFileError(
            f"serve.yaml's engine_dir {engine_dir} is not a Kiln engine folder here ({folder} has no {SIDECAR}; "
            f"Ray's working directory is {Path.cwd()})",
            hint="start Ray Serve from the package folder (engine_dir is relative to it): cd <package> && serve run "
            "ray/serve.yaml; on a Ray cluster started elsewhere, set the application's runtime_env.working_dir to "
            "the package (local:///shared/path/package)",
        )
    return folder


def say_capped(model_name: str, asked: int, served: int) -> None:
    """Warn where ``max_batch_size`` asks for more rows than the engine was validated for: batches stop at the
    largest validated one (:func:`served_max_batch`), as in ``kiln serve``, and a given option is not overridden
    without a word."""
    if 0 < served < asked:
        log.warning(
            "model %s: max_batch_size %d capped to %d, the largest batch its engine was validated at; to serve "
            "larger batches, add the size to signature.batch_sizes, validate and package again",
            model_name,
            asked,
            served,
        )


def _zeros(meta: EngineMetadata) -> dict[str, np.ndarray]:
    """One sample of zeros at the smallest validated size of each axis: a request any engine of the model takes."""
    sizes = {k: v[0] for k, v in meta.axis_ranges.items()}
    return {
        s.name: np.zeros([d if isinstance(d, int) and d > 0 else sizes.get(d, 1) for d in s.shape], dtype=s.dtype)
        for s in meta.inputs
    }


def _rows(feed: dict[str, np.ndarray]) -> int:
    return len(next(iter(feed.values())))


def build_app(args: dict[str, Any]) -> Any:
    """Ray Serve's application builder (``import_path: kiln.serve.ray_app:build_app``): ``args`` as the package
    stage writes them into ``serve.yaml`` (engine_dir, relative to the package folder: :func:`engine_folder`;
    model_name, replicas, gpus_per_replica, cpus_per_replica, max_batch_size, batch_wait_timeout_s). Batches are
    capped at the largest the engine was validated for (:func:`served_max_batch`)."""
    engine_folder(args["engine_dir"])  # where the app is built: not found fails the deploy, not each replica's start
    max_batch = int(args.get("max_batch_size", 32))
    return KilnEngine.options(
        name=args["model_name"],
        num_replicas=int(args.get("replicas", 1)),
        ray_actor_options={
            "num_gpus": float(args.get("gpus_per_replica", 0)),
            "num_cpus": float(args.get("cpus_per_replica", 1)),
        },
        # @serve.batch batches the requests a replica holds: Ray's default of 5 at a time capped every batch at 5
        # and queued the rest in front of the replica; room for a full batch forming while one runs
        max_ongoing_requests=max(5, 2 * max_batch),
    ).bind(
        str(args["engine_dir"]),
        args["model_name"],
        max_batch,
        float(args.get("batch_wait_timeout_s", 0.002)),
    )
