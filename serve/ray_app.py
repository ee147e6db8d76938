"""A Ray Serve application for one Kiln engine: what ``package/ray/serve.yaml`` starts (``serve run serve.yaml``),
on one machine or a Ray cluster, one application (one deployment) per engine.

The deployment speaks the KServe v2 inference protocol in JSON, as Triton's HTTP endpoint does: ``POST
/v2/models/<model>/infer`` with ``{"inputs": [{"name", "shape", "datatype", "data"}]}`` answers ``{"outputs":
[...]}``, and ``GET /v2/models/<model>/ready`` says whether the replica can answer; ``tritonclient.http`` (JSON
tensors) and ``kiln loadtest ray://...`` talk to it. Requests are checked against the engine's metadata before
they are queued (names, dtypes, shapes, the batch limit): a bad request is a 400 naming the problem, and never
reaches the batch of others. Requests are batched with ``@serve.batch`` up to ``max_batch_size`` rows; an unbatched
engine's (Triton's ``max_batch_size: 0``: clients send whole batches) run whole, one engine call each. A batch the
engine raises on runs again a request at a time, so that a request it refuses (a token id past the vocabulary)
fails alone, answered 400 while the engine still answers others. A replica whose engine failed (it no longer
answers the last request it answered) fails its health check, logged with the reason; Ray then replaces it, which
its controller logs too: nothing restarts silently.

Needs ``ray[serve]`` (``pip install "kiln[ray]"``), imported here: the package stage writes the config without it.
"""

from __future__ import annotations

import gc
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse

from kiln.core.records import EngineMetadata, TensorSpec
from kiln.stages.engines.backend import read_metadata
from kiln.stages.engines.registry import load_engine
from kiln.stages.package.triton import TRITON_TYPES, served_max_batch

log = logging.getLogger("ray.serve")
# KServe v2 datatypes by numpy dtype name (Triton's names without TYPE_)
V2_TYPES = {dtype: name.removeprefix("TYPE_") for dtype, name in TRITON_TYPES.items()}
V2_DTYPES = {name: dtype for dtype, name in V2_TYPES.items()}


class BadRequest(ValueError):
    """A request the engine cannot take; the message names the problem."""


def parse_request(body: Any, meta: EngineMetadata, max_rows: int) -> dict[str, np.ndarray]:
    """A v2 JSON request as the engine's feed, or :class:`BadRequest` saying what is wrong with it."""
    if not isinstance(body, dict) or not isinstance(body.get("inputs"), list):
        raise BadRequest('the body must be a JSON object with an "inputs" list (KServe v2 protocol)')
    names = [t.get("name") for t in body["inputs"] if isinstance(t, dict)]
    if twice := sorted({str(n) for n in names if names.count(n) > 1}):
        raise BadRequest(f"inputs {twice} given more than once")
    given = {t.get("name"): t for t in body["inputs"] if isinstance(t, dict)}
    want = [s.name for s in meta.inputs]
    if sorted(map(str, given)) != sorted(want):
        raise BadRequest(f"inputs {sorted(map(str, given))} given; the model takes {want}")
    feed = {s.name: _tensor(given[s.name], s.name, s.dtype) for s in meta.inputs}
    for spec in meta.inputs:  # before the ranges, which name axes by position: a wrong rank is said as such
        wrong = _misshapen(spec, feed[spec.name].shape)
        if wrong is not None:
            raise BadRequest(wrong)
    outside = meta.refusal(feed)
    if outside is not None:
        raise BadRequest(outside)
    rows = {len(v) for v in feed.values()}
    if len(rows) > 1:
        raise BadRequest(f"inputs have different batch sizes {sorted(rows)}")
    if max_rows and rows.pop() > max_rows:
        raise BadRequest(f"a batch of {len(feed[want[0]])} rows is over this server's limit of {max_rows}")
    return feed


def _misshapen(spec: TensorSpec, shape: tuple[int, ...]) -> str | None:
    """Why an array of ``shape`` is not what ``spec`` takes: its rank, or a fixed size past the batch axis; None
    when it fits."""
    dims = "[" + ", ".join(map(str, spec.shape)) + "]"
    if len(shape) != len(spec.shape):
        return f"input '{spec.name}' has {len(shape)} axes {list(shape)}; the model takes {len(spec.shape)}: {dims}"
    if any(isinstance(d, int) and d > 0 and i > 0 and shape[i] != d for i, d in enumerate(spec.shape)):
        return f"input '{spec.name}' has shape {list(shape)}; the model takes {dims}"
    return None


def _tensor(t: dict[str, Any], name: str, dtype: str) -> np.ndarray:
    if t.get("datatype") != V2_TYPES[dtype]:
        raise BadRequest(f"input '{name}' is {t.get('datatype')}; the model takes {V2_TYPES[dtype]}")
    shape = t.get("shape")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):  # true is no size
        raise BadRequest(f"input '{name}': shape must be a list of sizes, not {shape!r}")
    try:
        return np.asarray(t.get("data"), dtype=dtype).reshape(shape)
    except (ValueError, TypeError) as exc:
        raise BadRequest(f"input '{name}': data do not fit shape {shape} ({exc})") from None


class V2Response(JSONResponse):
    """An answer whose values may be infinite or NaN (a class masked with -inf on purpose, an overflow): written as
    JSON's common extension (``Infinity``, ``NaN``), as Python's json and tritonclient read them, where starlette's
    strict JSON would fail the request with a bare 500."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=False, allow_nan=True, separators=(",", ":")).encode()


def v2_outputs(model: str, outputs: dict[str, np.ndarray]) -> dict[str, Any]:
    return {
        "model_name": model,
        "outputs": [
            {"name": n, "shape": list(a.shape), "datatype": V2_TYPES[a.dtype.name], "data": a.ravel().tolist()}
            for n, a in outputs.items()
        ],
    }


@serve.deployment(health_check_period_s=5, health_check_timeout_s=30)
class KilnEngine:
    """One replica: the engine opened with ``load_engine`` (its files checked), requests batched (an unbatched
    engine's run whole, one engine call each)."""

    def __init__(self, engine_dir: str, model_name: str, max_batch_size: int, batch_wait_timeout_s: float) -> None:
        self.meta = read_metadata(Path(engine_dir))
        self.runner = load_engine(engine_dir, serving=True).activate()
        self.model_name = model_name
        self.max_rows = served_max_batch(self.meta, max_batch_size)
        self.failure: str | None = None
        self.answered: dict[str, np.ndarray] | None = None
        self.infer_batch.set_max_batch_size(max(1, self.max_rows))
        self.infer_batch.set_batch_wait_timeout_s(batch_wait_timeout_s)
        gc.freeze()  # the engine's and the libraries' objects out of the collector's sight (as the Triton stub)

    async def __call__(self, request: Request) -> JSONResponse:
        path = request.url.path.rstrip("/")
        if request.method == "GET" and path.endswith("/ready"):
            ready = self.failure is None
            return JSONResponse({"ready": ready} if ready else {"error": self.failure}, 200 if ready else 503)
        if request.method == "GET":
            return JSONResponse(self._metadata())
        if not path.endswith("/infer"):
            return JSONResponse({"error": f"no route {request.method} {path}: POST .../infer"}, 404)
        return await self._infer(request)

    async def _infer(self, request: Request) -> JSONResponse:
        try:
            feed = parse_request(await request.json(), self.meta, self.max_rows)
        except BadRequest as exc:
            return JSONResponse({"error": str(exc)}, 400)
        except ValueError:
            return JSONResponse({"error": "the body is not JSON"}, 400)
        if self.failure is not None:
            return JSONResponse({"error": f"this replica's engine failed: {self.failure}"}, 503)
        # An unbatched engine's request is a whole batch, run alone as Triton runs it: @serve.batch, whose size
        # counts rows, would hold it to one row.
        outputs = await self.infer_batch(feed) if self.max_rows else self._attempt(feed)
        if isinstance(outputs, Exception):
            return self._failed(outputs)
        self.answered = feed  # a request the engine answers: what tells a refused request from a failed engine
        return V2Response(v2_outputs(self.model_name, outputs))

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
    stage writes them into ``serve.yaml`` (engine_dir, model_name, replicas, gpus_per_replica, cpus_per_replica,
    max_batch_size, batch_wait_timeout_s)."""
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
