"""``kiln loadtest``: concurrent requests to a Triton server through ``tritonclient``, every answer checked.

Each concurrency level runs ``c`` threads, each with its own client (tritonclient's clients are not shared
between threads), sending single-sample requests round-robin from a pool for ``duration`` seconds or until
``max_requests`` answers, whichever comes first. The pool is real validation data (its first ``POOL`` samples) when
the run's dataset covers the engine's inputs, else random inputs of the engine's shapes (the report says which, and
why); its expected outputs come from the engine run in-process, one sample at a time, so an answer that went wrong
under load (mixed up between requests in a batch, truncated, of another model) is counted, reported and fails the
command.

``ray://127.0.0.1:8000`` drives the Ray Serve application the package stage writes (``package/ray/serve.yaml``)
the same way: it speaks the KServe v2 protocol in JSON, so the same HTTP client sends JSON tensors; it keeps no
Triton statistics, so its report has no server-side batch count.

``shared_memory``: requests carry no tensor bytes; the inputs sit in a system shared-memory region registered with
Triton (one per client process, the pool laid out once) and each answer is written into the client thread's own
region, as Triton's perf_analyzer does with ``--shared-memory system``. It measures the server without the cost of
moving tensors through HTTP/gRPC in Python, what a preprocessing process beside the server would see.

Each level's throughput is set beside the engine's own, timed in-process at a batch of the level's concurrency
(the most a server can batch from ``c`` single-sample requests), capped by the largest batch the server forms (its
model config's ``max_batch_size``; 1 for a server that forms none): the served/in-process ratio says what serving
costs.

Loopback only: this generates load, and is not meant to be pointed at someone else's server.
"""

from __future__ import annotations

import functools
import gc
import itertools
import json
import logging
import os
import secrets
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np

from kiln.core.artifacts import write_bytes_atomic, write_json_atomic, write_text_atomic
from kiln.core.compare import Masks, agrees, masks_of, set_aside
from kiln.core.data import feed_for_graph, rows, take
from kiln.core.errors import BackendUnavailable, ConfigError, GateFailure, KilnError
from kiln.core.inputs import largest_sizes, random_inputs
from kiln.core.records import EngineMetadata, TensorSpec
from kiln.core.timing import BUSY_SPREAD, median_interval
from kiln.models.config import ModelConfig
from kiln.models.model_io import dataset_for, on_random_inputs
from kiln.pipeline.config import KilnConfig
from kiln.serve import stub_times
from kiln.serve.batching import buckets_for, padded_infer
from kiln.serve.http_client import HttpClient, HttpError, infer_request, shm_tensor
from kiln.serve.server import CPU_MAX_BATCH, INSTALL_HINT, ServedEngine, find_engines
from kiln.stages.engines.registry import load_engine
from kiln.stages.package import INDEX as PACKAGE_INDEX
from kiln.stages.package.triton import served_max_batch

log = logging.getLogger("kiln.serve.loadtest")
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
POOL = 64  # the request pool's cap, in samples (`kiln loadtest --help` says it)
# (atol, rtol; rtol is relative to the answer's scale, answer_error) by engine precision: the base
# of the band a served answer is held to, for the rounding a batch's other kernels (another reduction order) bring.
# INT8 takes FP16's: a static INT8 engine answers alike in any batch. Where a sample's answer depends on its batch
# mates (dynamic quantization takes activation scales per batch), batch_deviation measures by how much and
# answer_band widens the band to BAND_SAFETY times that.
TOLERANCE = {"fp32": (1e-5, 1e-4), "fp16": (1e-3, 2e-2), "bf16": (1e-3, 3e-2), "int8": (1e-3, 2e-2)}
BAND_SAFETY = 4.0  # the band's rtol is at least this many times the largest batch-mate deviation measured
BAND_CAP = 0.1  # ... and at most this: beyond it a batch-mate's answer would pass for any sample's (said in the log),
SEPARATION_SHARE = 0.5  # ... or this share of how far apart the requests' answers lie, where larger (band_cap)
SEPARATION_VALUES = 2e8  # answer_separation compares every two answers: up to this many values in all (seconds)
BAND_ROWS = 8  # the small batch measured, beside the largest the server forms
REQUEST_TIMEOUT_S = 60.0  # one request; the level's loop is bounded by its duration and request budget
# The client threads' interpreter switch interval (Python's default is 5 ms): a thread whose answer has arrived waits
# up to that long for the lock while another thread of its process runs, and the wait lands on its latency. On the
# H200 (8 stubs, c = 64, benchmarks/README.md) 200 us served more requests with a shorter tail than 5 ms.
CLIENT_SWITCH_S = 200e-6
TAIL_WINDOW_S = 0.1  # tail_windows' window
TAIL_MIN_WINDOWS = 20  # fewer windows than this: tail_windows says nothing
TAIL_MIN_SLOW = 10  # fewer slow requests than this: no share (one or two sit in one window whatever the spread)
# requests in a row that found no server (connection refused) or no model (unloaded by a stopping server): it is
# gone, and the level stops
GONE_AFTER = 3
# how Triton answers a request for a model it has unloaded (a server stopping unloads its models before it closes)
UNLOADED = "has no available versions"
# why the requests are random where neither -c nor a workdir's recorded run gives data (none is made up)
NO_DATA = (
    "no data given, so random arrays of the engine's recorded shapes and ranges; to send real data, give -c CONFIG "
    "(a config whose data.name gives the engine's inputs) or -e WORKDIR (the `kiln run` workdir it came from)"
)


@dataclass
class Level:
    concurrency: int
    latencies_ms: list[float] = field(default_factory=list)
    mismatches: int = 0
    errors: list[str] = field(default_factory=list)
    max_abs_err: float = 0.0
    worst_wrong: float = 0.0  # the largest error of a wrong answer, of its scale (relative_error): 0 where none was
    seconds: float = 0.0
    switch_interval_s: float = 0.0  # the clients' thread switch interval while they ran
    client: str = "tritonclient"  # what sent the requests: tritonclient, or kiln's HTTP client (kiln.serve.http_client)
    sent_ns: list[int] = field(default_factory=list)  # when each request of latencies_ms was sent (monotonic clock)
    cpu: dict[str, float | int] | None = None  # CpuMeter over the client threads' run, from start to join
    collections: dict[str, float] | None = None  # the client processes' garbage collections meanwhile (Collections)
    # the server went away during the level (GONE_AFTER requests in a row refused), which then stopped: ``seconds``
    # is the time until its last answer, what its throughput counts
    server_gone: bool = False
    last_answer_s: float = 0.0  # seconds from the level's start to its last answer: ``seconds`` once the server is gone
    gone_error: str = ""  # the last request's error that found no server: what the stop says, not a later error

    def summary(self) -> dict[str, Any]:
        lat = np.asarray(self.latencies_ms) if self.latencies_ms else np.asarray([np.nan])
        p50, p90, p99 = np.percentile(lat, [50, 90, 99])
        return {
            "concurrency": self.concurrency,
            "requests": len(self.latencies_ms),
            "seconds": self.seconds,
            "last_answer_s": self.last_answer_s,
            "throughput_rps": len(self.latencies_ms) / self.seconds if self.seconds else 0.0,
            "latency_ms": {"p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(lat.mean())},
            "mismatches": self.mismatches,
            "errors": len(self.errors),
            "error_examples": self.errors[:3],
            "max_abs_err": self.max_abs_err,
            "worst_wrong": self.worst_wrong,
            "client_switch_interval_s": self.switch_interval_s,
            "client": self.client,
            "tail_windows": tail_windows(self.sent_ns, self.latencies_ms),
            "slow_requests": int(np.count_nonzero(lat > stub_times.SLOW_S * 1e3)),
            "cpu_cores": self.cpu,
            "client_collections": self.collections,
            **({"server_gone": True} if self.server_gone else {}),
        }


class Collections:
    """The interpreter's garbage collections inside the block, through :data:`gc.callbacks`: how many, how many
    of the oldest generation, their total and their longest pause. Every thread of the process waits through a
    collection, so a load generator's own pauses would land on the latencies it reports."""

    def __init__(self) -> None:
        self.started = 0.0
        self.seen = {"collections": 0, "full": 0, "total_ms": 0.0, "longest_ms": 0.0}

    def __enter__(self) -> Collections:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self.started = time.perf_counter()
            return
        ms = (time.perf_counter() - self.started) * 1e3
        seen = self.seen
        seen["collections"] += 1
        seen["full"] += info["generation"] == 2
        seen["total_ms"] += ms
        seen["longest_ms"] = max(seen["longest_ms"], ms)


def tail_windows(
    sent_ns: list[int], latencies_ms: list[float], window_s: float = TAIL_WINDOW_S
) -> dict[str, Any] | None:
    """Where the level's slow requests (above its p99) were sent, by ``window_s`` windows of the run: a tail
    spread over the windows is the server's steady behaviour (queueing, scheduling); one gathered in a few is a
    stall (a collection, a compile, a swap). ``share_in_worst_10pct``: the slow requests' share in the tenth of
    the windows that hold most of them (about 0.1 when spread evenly, near 1 when gathered), None where fewer than
    :data:`TAIL_MIN_SLOW` requests are slow: one or two fill a tenth of the windows whatever the spread. None for
    fewer than :data:`TAIL_MIN_WINDOWS` windows or 100 requests, where an even spread no longer reads as 0.1."""
    if len(latencies_ms) < 100 or len(sent_ns) != len(latencies_ms):
        return None
    sent, lat = np.asarray(sent_ns, dtype=np.int64) / 1e9, np.asarray(latencies_ms)
    window = ((sent - sent.min()) // window_s).astype(int)
    if window.max() + 1 < TAIL_MIN_WINDOWS:
        return None
    slow = np.bincount(window[lat > np.percentile(lat, 99)], minlength=window.max() + 1)
    worst = np.sort(slow)[::-1][: max(1, len(slow) // 10)]
    return {
        "window_s": window_s,
        "windows": len(slow),
        "slow": int(slow.sum()),
        "windows_with_slow": int(np.count_nonzero(slow)),
        "share_in_worst_10pct": float(worst.sum() / slow.sum()) if slow.sum() >= TAIL_MIN_SLOW else None,
    }


# Processes counted as the server's in a level's CPU use: Triton and its Python-backend stubs, Ray's workers
SERVER_PROCESSES = ("tritonserver", "triton_python_backend_stub")
SERVER_PREFIXES = ("ray::", "raylet", "gcs_server")


class CpuMeter:
    """CPU time spent during a level, in cores (CPU seconds per wall second): the whole machine's busy time, the
    server's processes (:data:`SERVER_PROCESSES`, found by name) and the load test's own clients (this process
    and its finished child processes). Where the machine is near all its cores busy, the clients and the server
    share too few of them and the level measures that, not the server alone."""

    def __init__(self) -> None:
        import resource

        import psutil

        self.psutil, self.resource = psutil, resource
        self.start = time.perf_counter()
        self.machine = psutil.cpu_times()
        self.server = self._server_times()
        self.clients = self._client_seconds()

    def _server_times(self) -> dict[int, float]:
        times = {}
        for proc in self.psutil.process_iter(["name", "cpu_times"]):
            name, cpu = proc.info["name"] or "", proc.info["cpu_times"]
            if cpu is not None and (name in SERVER_PROCESSES or name.startswith(SERVER_PREFIXES)):
                times[proc.pid] = cpu.user + cpu.system
        return times

    def _client_seconds(self) -> float:
        own = self.resource.getrusage(self.resource.RUSAGE_SELF)
        children = self.resource.getrusage(self.resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime

    def read(self) -> dict[str, float | int]:
        """Cores used since the meter started: ``busy`` (machine), ``server``, ``clients``; ``cores`` (all) and
        ``seconds`` (wall)."""
        wall = max(time.perf_counter() - self.start, 1e-9)
        now = self.psutil.cpu_times()
        idle = (now.idle - self.machine.idle) + (getattr(now, "iowait", 0.0) - getattr(self.machine, "iowait", 0.0))
        total = _total(now) - _total(self.machine)
        server = self._server_times()
        cores = self.psutil.cpu_count() or 1
        return {
            "cores": cores,
            "seconds": round(wall, 3),
            "busy": round(cores * (1 - idle / total), 3) if total > 0 else 0.0,
            "server": round(sum(t - self.server[p] for p, t in server.items() if p in self.server) / wall, 3),
            "clients": round((self._client_seconds() - self.clients) / wall, 3),
        }


def _total(times: Any) -> float:
    """All CPU time in psutil's ``cpu_times()``; Linux counts guest time inside user time too, so it is taken out
    (as psutil's own ``cpu_percent`` does)."""
    return sum(times) - getattr(times, "guest", 0.0) - getattr(times, "guest_nice", 0.0)


def parse_url(url: str) -> tuple[str, str]:
    """``http://127.0.0.1:8000``, ``grpc://127.0.0.1:8001`` or ``ray://127.0.0.1:8000`` (Ray Serve) ->
    (protocol, "host:port"); loopback only."""
    parsed = urlparse(url if "://" in url else f"http://{url}")
    if parsed.scheme not in ("http", "grpc", "ray") or not parsed.port:
        raise ConfigError(
            f"'{url}' is not a server URL",
            hint="give http://127.0.0.1:PORT or grpc://127.0.0.1:PORT (Triton), or ray://127.0.0.1:PORT (Ray Serve)",
        )
    if parsed.hostname not in LOOPBACK:
        raise ConfigError(
            f"'{parsed.hostname}' is not this machine: kiln loadtest only targets 127.0.0.1",
            hint="run the load test on the server's machine against 127.0.0.1",
        )
    return parsed.scheme, f"{parsed.hostname}:{parsed.port}"


def _client_module(protocol: str) -> Any:
    try:
        if protocol == "grpc":
            import tritonclient.grpc as module
        else:
            import tritonclient.http as module
    except ImportError:
        raise BackendUnavailable(
            f"kiln loadtest needs tritonclient[{protocol}], which is not installed", hint=INSTALL_HINT
        ) from None
    return module


def engine_for(path: str | Path, model: str) -> ServedEngine:
    """The engine behind ``model``: a name `kiln serve` gives, or one of the package's Triton repositories."""
    engines = find_engines(path)
    aliases = _repository_names(Path(path))
    for e in engines:
        if model == e.model_name or aliases.get(model) == e.meta.name:
            return e
    here = {e.meta.name for e in engines}  # the package's record names every engine's aliases, not only these
    names = {e.model_name for e in engines} | {alias for alias, engine in aliases.items() if engine in here}
    raise ConfigError(f"no engine served as '{model}' under {path}", hint=f"--model is one of {sorted(names)}")


def default_model(path: str | Path) -> str:
    """The model to load-test when none is named: the only engine ``path`` serves, else the one validation chose at
    its largest batch size (the engine a client of the package is pointed to)."""
    engines = find_engines(path)
    if len(engines) == 1:
        return engines[0].model_name
    chosen = _run_file(Path(path), "validate/validation.json")
    picks = json.loads(chosen.read_text()).get("chosen", {}) if chosen else {}
    best = picks[max(picks, key=int)] if picks else None
    served = {e.meta.name: e.model_name for e in engines}
    if best in served:
        log.info("load-testing %s, the engine validation chose at batch %s (--model names another)", best, max(picks))
        return served[best]
    raise ConfigError(
        f"{path} serves {len(engines)} engines and none was chosen by validation",
        hint=f"--model is one of {sorted(served.values())}",
    )


def recorded_config(path: str | Path) -> KilnConfig | None:
    """The sections of the run's config that say where its data come from (model, data, signature, seed), as its
    validation recorded them in the workdir of ``path`` (a workdir or an engine folder in it); None where there is
    no such record."""
    manifest = _run_file(Path(path), "validate/manifest.json")
    if manifest is None:
        return None
    recorded = json.loads(manifest.read_text()).get("key_parts", {}).get("config", {})
    sections = {k: recorded[k] for k in ("seed", "model", "data", "signature") if k in recorded}
    model = sections.get("model", {})
    if model.get("onnx") and model.get("name") == ModelConfig.model_fields["name"].default:
        # the record holds every default: a run from an ONNX file named no PyTorch model unless it names another
        sections["model"] = {k: v for k, v in model.items() if k != "name"}
    try:
        return KilnConfig.model_validate(sections) if "model" in sections else None
    except ValueError:  # a record of another Kiln's config schema: the caller's default instead
        return None


def recorded_code_roots(path: str | Path) -> list[Path]:
    """The folders the run of ``path`` (a workdir or an engine folder in it) imported its user code from, as its
    validation recorded them: where the data function resolves when `kiln loadtest` runs elsewhere."""
    manifest = _run_file(Path(path), "validate/manifest.json")
    roots = json.loads(manifest.read_text()).get("code_roots", []) if manifest is not None else []
    on_path = {str(Path(p).resolve()) for p in sys.path if p}  # PYTHONPATH's: importable already, left as they are
    return [Path(r) for r in roots if Path(r).is_dir() and str(Path(r).resolve()) not in on_path]


def run_workdir(path: str | Path) -> Path:
    """The workdir of ``path``: the workdir itself, or an engine folder's (build/x, package/engines/x)."""
    path = Path(path)
    if path.parent.name == "build":
        return path.parent.parent
    if path.parent.name == "engines" and path.parent.parent.name == "package":
        return path.parent.parent.parent
    return path


def _run_file(path: Path, name: str) -> Path | None:
    """``name`` in the workdir of ``path`` (:func:`run_workdir`)."""
    workdir = run_workdir(path)
    return workdir / name if (workdir / name).is_file() else None


def _repository_names(path: Path) -> dict[str, str]:
    """Triton model name -> engine name, from the package stage's record (its repositories' names), found from a
    workdir, a package folder, or an engine folder in either (``package/engines/<engine>``, ``build/<engine>``)."""
    places = (path / "package", path, path.parent.parent, path.parent.parent / "package")
    record = next((p / PACKAGE_INDEX for p in places if (p / PACKAGE_INDEX).is_file()), None)
    if record is None:
        return {}
    models = json.loads(record.read_text()).get("models", [])
    return {m[key]: m["engine"] for m in models for key in ("triton_model", "triton_python_model") if key in m}


def request_pool(engine: ServedEngine, config: KilnConfig | None, size: int = POOL) -> tuple[list[dict], str]:
    """Single-sample feeds and where they came from: the run's first ``size`` validation samples when they cover
    every input of the engine (by name for a dict, by position otherwise, with the engine's dtypes and fixed sizes),
    else random arrays of the engine's shapes, with the reason."""
    specs = engine.meta.inputs
    if config is None:
        why = NO_DATA
    elif on_random_inputs(config.model, config.data):
        why = "the run has no data: model.onnx without data.name"
    else:
        try:
            data = dataset_for(config.model, config.data, config.signature, config.seed)
            feed = feed_for_graph(
                take(data.val_x, slice(0, size)), [s.name for s in specs], f"engine {engine.meta.name}"
            )
            feed = {s.name: fit(s, feed[s.name]) for s in specs}
        except KilnError as exc:
            why = exc.message
        else:
            n, total = len(next(iter(feed.values()))), rows(data.val_x)
            pool = [{k: v[i : i + 1] for k, v in feed.items()} for i in range(n)]
            held = f"the first {n} of its {total} samples: the pool's cap" if total > n else f"{n} samples"
            return pool, f"real validation data of dataset '{config.data.name or data.name}' ({held})"
    # an axis besides the batch at the largest size the engine was validated for
    sizes = largest_sizes(specs, engine.meta.axis_ranges)
    hint = "give the run's config (-c) so that its validation data become the requests"
    ranges = engine.meta.index_ranges  # ids within the tables the graph indexes, a float timestep's too
    pool = [random_inputs(specs, 1, sizes, seed=i, hint=hint, int_ranges=ranges) for i in range(size)]
    shapes = ", ".join(f"{k} {v.dtype}{list(v.shape)}" for k, v in pool[0].items())
    log.warning("engine %s gets RANDOM inputs (%s): %s", engine.meta.name, shapes, why)
    return pool, f"RANDOM ({size} samples; {why})"


def request_shapes(pool: list[dict]) -> dict[str, list[list[int]]]:
    """The shapes each input had in the requests sent (each distinct one once, in the pool's order): what a
    throughput figure was measured at, a dynamic axis's size (a point count, a sequence length) included."""
    shapes: dict[str, list[list[int]]] = {}
    for feed in pool:
        for name, array in feed.items():
            seen = shapes.setdefault(name, [])
            if list(array.shape) not in seen:
                seen.append(list(array.shape))
    return shapes


def dynamic_sizes(meta: EngineMetadata, pool: list[dict]) -> dict[str, list[int]]:
    """The sizes the requests sent gave each named axis of the engine's inputs past the batch axis (``N``: the
    points of a cloud), smallest first; axes of no request are left out."""
    sizes: dict[str, set[int]] = {}
    for spec in meta.inputs:
        for feed in pool:
            array = feed.get(spec.name)
            for axis, dim in list(enumerate(spec.shape))[1:]:
                if isinstance(dim, str) and array is not None and axis < array.ndim:
                    sizes.setdefault(dim, set()).add(int(array.shape[axis]))
    return {name: sorted(found) for name, found in sizes.items()}


def shapes_said(result: dict[str, Any]) -> str:
    """The report's line on what each request carried (:func:`request_shapes`, :func:`dynamic_sizes`); empty for a
    result written before it was recorded."""
    shapes = result.get("request_shapes")
    if not shapes:
        return ""
    each = "; ".join(f"{name}: {', '.join(map(str, found))}" for name, found in shapes.items())
    dynamic = result.get("dynamic_sizes") or {}
    axes = ", ".join(f"{name} = {' or '.join(map(str, found))}" for name, found in dynamic.items())
    return f"Each request's inputs: {each}" + (f" (dynamic axes: {axes})." if axes else ".")


def fit(spec: TensorSpec, array: np.ndarray) -> np.ndarray:
    """``array`` as the engine's input ``spec`` takes it (its dtype), or a ConfigError saying why it cannot be."""
    want = [d if isinstance(d, int) and d > 0 else None for d in spec.shape]
    shape_ok = array.ndim == len(want) and all(w in (None, g) for w, g in zip(want[1:], array.shape[1:]))
    kinds = {np.dtype(spec.dtype).kind, array.dtype.kind}
    kind_ok = len(kinds) == 1 or kinds <= set("iu")  # int32 data for an int64 input: the same values
    if not (shape_ok and kind_ok):
        dims = ", ".join(str(d) if isinstance(d, int) and d > 0 else str(d or "?") for d in spec.shape)
        raise ConfigError(
            f"the data's input '{spec.name}' is {array.dtype}{list(array.shape)}, the engine takes {spec.dtype}[{dims}]"
        )
    return array.astype(spec.dtype)


def expected_outputs(runner: Any, pool: list[dict]) -> list[dict[str, np.ndarray]]:
    """The engine's own answer to each request of the pool, one sample at a time."""
    return [{k: np.asarray(v) for k, v in runner.infer(feed).items()} for feed in pool]


def batch_deviation(
    runner: Any, pool: list[dict], expected: list[dict], limit: int, base: tuple[float, float]
) -> dict[str, Any]:
    """How far the engine's answers batched with others lie from its single-sample ones (``expected``): the pool
    run in whole batches of :data:`BAND_ROWS` and of ``limit`` rows (the server's largest batch, padded as the
    server pads it). Per output, the rtol (of the answer's scale, as :func:`answer_error` counts it) a batched
    answer needs beside the ``base`` atol; ``largest``: per output, the largest error itself (of the answer's scale),
    which the base tolerance may cover, leaving an rtol of 0 though batching moved the answers; ``atol``: the error
    of answers with no value to scale by. A static engine's is about 0; a dynamically quantized one's is the band
    its batch mates move it by."""
    size = min(limit, len(pool))
    batches = sorted({min(BAND_ROWS, size), size} - {0, 1})
    buckets = buckets_for(runner, limit)
    outputs = list(expected[0])
    masks = answer_masks(expected, outputs)
    scales = answer_scales(expected, masks)
    rtol, largest, atol = dict.fromkeys(outputs, 0.0), dict.fromkeys(outputs, 0.0), 0.0
    for b in batches:
        for start in range(0, len(pool) - b + 1, b):
            feed = {k: np.concatenate([r[k] for r in pool[start : start + b]]) for k in pool[0]}
            got = padded_infer(runner, feed, buckets)
            for i, want in enumerate(expected[start : start + b]):
                for name in outputs:
                    rows = np.asarray(got[name])
                    if len(rows) != b or rows[i : i + 1].shape != want[name].shape:
                        continue  # an output without a row per sample: nothing to set beside the single answer
                    err, scale = _error_and_scale(want[name], rows[i : i + 1], masks[name], scales[name])
                    if scale > 0:
                        rtol[name] = worse(rtol[name], max(0.0, err - base[0]) / scale)
                        largest[name] = worse(largest[name], err / scale)
                    else:
                        atol = worse(atol, err)
    moved = BAND_SAFETY * max((v for v in rtol.values() if np.isfinite(v)), default=0.0)
    apart = answer_separation(expected, masks, scales) if moved > BAND_CAP else None  # only where it may widen
    return {"batches": batches, "rtol": rtol, "largest": largest, "atol": atol, "separation": apart}


def answer_separation(expected: list[dict], masks: dict[str, Masks], scales: dict[str, float]) -> float | None:
    """How far apart the requests' answers lie: over every two requests whose answers differ, the largest error
    (of the answer's scale, as :func:`answer_error` counts it) of one's answer held against the other's, over their
    outputs, at its smallest. A band under it still counts another request's answer wrong (a server that mixes up
    its batch's rows), however far batching moves the engine's own answers. None where no two answers compare, or
    comparing them all would take more than :data:`SEPARATION_VALUES` values."""
    if len(expected) ** 2 * sum(np.size(v) for v in expected[0].values()) > SEPARATION_VALUES:
        return None
    nearest = None
    for i, want in enumerate(expected):
        for j, other in enumerate(expected):
            if i == j or any(other[n].shape != want[n].shape for n in want):
                continue  # answers of another shape are told apart by it
            apart = max(relative_error(want[n], other[n], masks[n], scales[n]) for n in want)
            if apart > 0:  # two requests with the same answer: a mix-up of them is no wrong answer
                nearest = apart if nearest is None else min(nearest, apart)
    return nearest


def relative_error(want: np.ndarray, got: np.ndarray, masks: Masks, typical: float) -> float:
    """``got``'s error against ``want`` in units of the answer's scale (:func:`_error_and_scale`), as a band's rtol
    counts it."""
    err, scale = _error_and_scale(want, got, masks, typical)
    return err / scale if scale > 0 else (float("inf") if err > 0 else 0.0)


def _error_and_scale(want: np.ndarray, got: np.ndarray, masks: Masks, typical: float) -> tuple[float, float]:
    """The largest error of ``got`` against ``want`` (as :func:`~kiln.core.compare.agrees` counts it) and the
    answer's scale: the largest magnitude of ``want``'s values compared, or the output's ``typical`` magnitude
    (:func:`answer_scales`) where that is larger."""
    _, err = agrees(want, got, 0.0, 0.0, masks)
    r = np.asarray(want, dtype=np.float64)
    compared = ~set_aside(r, got, masks) & np.isfinite(r) & ~np.isin(r, masks.values)
    return err, max(float(np.max(np.abs(r[compared]), initial=0.0)), typical)


def band_cap(deviation: dict[str, Any]) -> float:
    """The widest rtol a served answer may be held to: :data:`BAND_CAP`, or where the requests' answers lie further
    apart (:func:`answer_separation`, measured where batching moves the engine's answers past the cap)
    :data:`SEPARATION_SHARE` of that, so that another request's answer stays wrong in either case."""
    apart = deviation.get("separation")
    return max(BAND_CAP, SEPARATION_SHARE * apart) if apart is not None and np.isfinite(apart) else BAND_CAP


def answer_band(base: tuple[float, float], deviation: dict[str, Any]) -> tuple[float, float]:
    """The tolerance served answers are held to: ``base``, widened to :data:`BAND_SAFETY` times the batch-mate
    deviation measured (:func:`batch_deviation`), up to :func:`band_cap`. A deviation that is not finite (a batched
    answer with a NaN or an infinity its single answer lacks) widens nothing: a served batch would give that answer,
    which is wrong."""
    if not all(np.isfinite(v) for v in (*deviation["rtol"].values(), deviation["atol"])):
        log.warning("batched, the engine answers with non-finite values its single-sample answers lack")
    rtols = [v for v in deviation["rtol"].values() if np.isfinite(v)]
    atol = deviation["atol"] if np.isfinite(deviation["atol"]) else 0.0
    rtol, cap = BAND_SAFETY * max(rtols, default=0.0), band_cap(deviation)
    if rtol > cap:
        log.warning(
            "batched, the engine's answers move by up to %.3g of their scale: answers are held to %.3g (beyond it "
            "another request's answer could pass), and a correct server may be counted wrong (an engine whose "
            "answers depend on their batch mates)",
            rtol / BAND_SAFETY,
            cap,
        )
    return max(base[0], min(BAND_SAFETY * atol, BAND_CAP)), max(base[1], min(rtol, cap))


def batching_cause(
    deviation: dict[str, Any], tolerance: tuple[float, float], worst: float, meta: EngineMetadata | None = None
) -> str | None:
    """Why a correct server's answers were counted wrong, where batching moves the engine's own answers past what
    they could be held to (:func:`answer_band` capped the band) and the wrong answers, off by up to ``worst`` of
    their scale, lie within :data:`BAND_SAFETY` times what it moves them by; None otherwise (the server's fault: an
    answer further off is no batch mate's doing). ``meta``: the engine's metadata, which names what moves its
    answers (:func:`batch_mover`)."""
    moved = max((v for v in deviation["rtol"].values() if np.isfinite(v)), default=0.0)
    if not tolerance[1] < BAND_SAFETY * moved or not worst <= BAND_SAFETY * moved:
        return None
    return (
        f"the engine answers differently in a batch than alone: in batches of "
        f"{', '.join(map(str, deviation['batches']))} its answers move by up to {moved:.3g} of their scale, and "
        f"answers can be held to no more than {tolerance[1]:.3g} (where another request's answer is still wrong); "
        f"the wrong ones were off by up to {worst:.3g}, within {BAND_SAFETY:g} x that, as the server's dynamic "
        f"batching moves them ({batch_mover(meta)})"
    )


BATCH_SCALES = "a quantized engine that computes its activation scales per batch (dynamic INT8, tensorwise FP8)"
COUPLED_MODEL = (
    "the model's rows read their batch mates: a batch-coupled model, such as a normalization or a branch on a "
    "statistic over the whole batch"
)
# the setting that gives each backend's quantized engines static scales, and the page that tells of it
STATIC_SCALES = {
    "onnxruntime": "calibration.ort_cpu_scheme: static, docs/stages.md",
    "torch": "build.torch.lowbit_scaling: static, docs/engines.md",
}


def batch_scaling(meta: EngineMetadata) -> str | None:
    """How an INT8 or FP8 engine whose quantization scales span the batch finds them at each call, else None.

    ONNX Runtime's INT8 engines are dynamically quantized unless the precision stage chose the static scheme
    (recorded as ``ort_cpu_scheme`` where the builder records it). A torch FP8 or INT8 engine records its
    ``lowbit_scaling``: tensorwise takes each layer input's largest magnitude over the whole batch; static scales
    are fixed at the build and rowwise ones are each row's own, which its batch mates do not move. TensorRT's are
    calibrated, fixed."""
    settings = meta.builder_settings
    if meta.precision not in ("int8", "fp8"):
        return None
    if meta.backend == "torch":
        scaling = settings.get("lowbit_scaling", "tensorwise")
        return f"build.torch.lowbit_scaling {scaling}" if scaling == "tensorwise" else None
    if meta.backend == "onnxruntime" and settings.get("ort_cpu_scheme", "dynamic") == "dynamic":
        return "dynamically quantized"
    return None


def batch_mover(meta: EngineMetadata | None) -> str:
    """What makes an engine answer otherwise in a batch than alone: a quantized engine's scales found over each
    batch (:func:`batch_scaling`); any other engine computes each row as it would alone, up to rounding, so the model
    itself mixes rows. Both where the engine is not known."""
    if meta is None:
        return f"{BATCH_SCALES}, or {COUPLED_MODEL}"
    scaling = batch_scaling(meta)
    if scaling is None:
        return COUPLED_MODEL
    if meta.backend == "torch":
        return f"an {meta.precision.upper()} engine with {scaling} computes its activation scales per batch"
    return f"a {scaling} {meta.precision.upper()} engine computes its activation scales per batch"


def batching_hint(engines: str | Path, engine: ServedEngine, protocol: str) -> str:
    """The fix for an engine whose answers depend on their batch mates (:func:`batching_cause`): a load test of an
    engine that answers alike in any batch, or of this one served unbatched, tells the server's own faults. For a
    quantized engine whose scales span the batch, names the FP32 engine served beside it, of its own backend and
    device first, and the setting that gives its backend static scales; for another, whose model mixes rows, serving
    it unbatched is the fix, and a validation that finds the coupling packages it so."""
    unbatched = "this one served without batching (kiln serve --max-batch 0)" if protocol != "ray" else ""
    meta = engine.meta
    if batch_scaling(meta) is None:
        served = f"serve {unbatched}" if unbatched else "serve it without batching"
        return (
            f"{served}, or rerun validation (kiln run --from validate) so that it finds the outputs that depend on "
            "the whole batch and packages the engines unbatched; if its answers differ unbatched too, check that "
            "the server serves the engine -e names"
        )
    own = (meta.backend, meta.device)
    fp32 = [e for e in find_engines(engines) if e.meta.precision == "fp32"]
    fp32.sort(key=lambda e: ((e.meta.backend, e.meta.device) != own, e.model_name))
    return (
        f"load-test the FP32 engine (--model {fp32[0].model_name if fp32 else 'NAME'}) or an {meta.precision.upper()} "
        f"engine with static scales ({STATIC_SCALES[meta.backend]}){', or ' + unbatched if unbatched else ''}"
        "; if its answers differ too, check that the server serves the engine -e names"
    )


def triton_feed(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``feed`` as a Triton server takes it: a 0-d input (an engine's scalar) as shape ``[1]``, the ``dims: [ 1 ]``
    it is declared with (:func:`~kiln.stages.package.triton.scalar_tensors`), which Triton refuses ``[]`` for;
    every other input as it is. Ray Serve's application takes the engine's own shapes."""
    return {name: array.reshape(1) if array.ndim == 0 else array for name, array in feed.items()}


def as_expected(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """A served answer in the shape of the engine's ``want``, where Triton returns a 0-d output (declared
    ``dims: [ 1 ]``, :func:`triton_feed`) as ``[1]``; any other answer as it came, its shape checked as it is."""
    return got.reshape(want.shape) if want.ndim == 0 and got.size == 1 else got


def _inputs(module: Any, feed: dict[str, np.ndarray], binary: bool = True) -> list[Any]:
    """tritonclient's input tensors; ``binary`` False: JSON data (the Ray Serve app reads JSON only)."""
    from tritonclient.utils import np_to_triton_dtype

    out = []
    for name, array in feed.items():
        tensor = module.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        if binary:
            tensor.set_data_from_numpy(array)
        else:
            tensor.set_data_from_numpy(array, binary_data=False)
        out.append(tensor)
    return out


def _client(module: Any, protocol: str, address: str) -> tuple[Any, dict[str, float]]:
    """A client of ``address`` and the keyword that bounds one request's wait."""
    if protocol == "grpc":
        return module.InferenceServerClient(address), {"client_timeout": REQUEST_TIMEOUT_S}
    return module.InferenceServerClient(address, network_timeout=REQUEST_TIMEOUT_S), {}


UNREGISTER_WAIT_S = 10.0  # how long close() waits for the server to let go of a region its last requests held
# A stopped load test (Ctrl-C, SIGTERM): its client processes get STOP_WAIT_S in all to end their level and release
# their regions (their threads HALT_WAIT_S of it to finish the request in flight, close() the rest), then are killed
STOP_WAIT_S = 3.0
HALT_WAIT_S = 1.0


class SharedMemory:
    """System shared-memory regions registered with the server: the pool's inputs laid out once (Triton only reads
    them, so every thread of the process sends from it) and one output region per client thread. Each request's
    tensors are kept as KServe's JSON says them (``input_specs`` per request of the pool, ``output_specs`` per
    thread), what Kiln's HTTP client sends as they are; tritonclient's objects are made from them
    (:meth:`tritonclient_inputs`, :meth:`tritonclient_outputs`).

    Names are unique to each instance (process, instance count, a random token): Triton holds a region until the
    requests that used it are released, a moment after their answers arrive, so a name used again at once can still
    be in its manager."""

    _made = itertools.count()

    def __init__(self, module: Any, client: Any, pool: list[dict], expected: list[dict], threads: int) -> None:
        import tritonclient.utils.shared_memory as shm

        self.shm, self.module, self.client, self.handles = shm, module, client, {}
        try:
            self._lay_out(pool, expected, threads)
        except BaseException:  # no region left behind, registered or in /dev/shm
            self.close()
            raise

    def _lay_out(self, pool: list[dict], expected: list[dict], threads: int) -> None:
        tag = f"kiln_{os.getpid()}_{next(self._made)}_{secrets.token_hex(3)}"
        arrays = [{n: np.ascontiguousarray(a) for n, a in feed.items()} for feed in pool]
        region = f"{tag}_in"
        handle = self._region(region, sum(a.nbytes for feed in arrays for a in feed.values()))
        self.input_specs, offset = [], 0
        for feed in arrays:
            specs = []
            for name, array in feed.items():
                self.shm.set_shared_memory_region(handle, [array], offset=offset)
                specs.append(
                    shm_tensor(name, list(array.shape), _triton_dtype(array.dtype), region, array.nbytes, offset)
                )
                offset += array.nbytes
            self.input_specs.append(specs)
        # each output at a fixed place in a thread's region, sized for the largest answer in the pool
        sizes = {n: max(1, max(e[n].nbytes for e in expected)) for n in expected[0]}
        self.output_handles, self.output_specs = [], []
        for t in range(threads):
            region, offset, specs = f"{tag}_out{t}", 0, []
            self.output_handles.append(self._region(region, sum(sizes.values())))
            for n, size in sizes.items():
                specs.append(shm_tensor(n, None, None, region, size, offset))
                offset += size
            self.output_specs.append(specs)

    def tritonclient_inputs(self, k: int) -> list[Any]:
        """Request ``k``'s inputs as tritonclient's ``InferInput`` objects, pointing into the pool's region."""
        out = []
        for spec in self.input_specs[k]:
            tensor = self.module.InferInput(spec["name"], spec["shape"], spec["datatype"])
            tensor.set_shared_memory(*_place(spec))
            out.append(tensor)
        return out

    def tritonclient_outputs(self, thread: int) -> list[Any]:
        """Thread ``thread``'s requested outputs as tritonclient's ``InferRequestedOutput`` objects, into its region."""
        out = []
        for spec in self.output_specs[thread]:
            tensor = self.module.InferRequestedOutput(spec["name"])
            tensor.set_shared_memory(*_place(spec))
            out.append(tensor)
        return out

    def _region(self, name: str, size: int) -> Any:
        handle = self.shm.create_shared_memory_region(name, f"/{name}", size)
        self.handles[name] = handle
        self.client.register_system_shared_memory(name, f"/{name}", size)
        return handle

    def answer(
        self, thread: int, shapes: dict[str, list[int] | None], want: dict[str, np.ndarray]
    ) -> dict[str, np.ndarray | None]:
        """Thread ``thread``'s answer, read from its region in the ``shapes`` the server declared for each output
        (None: not in the answer; a copy: the next request writes over it)."""
        handle = self.output_handles[thread]
        got: dict[str, np.ndarray | None] = {}
        for spec in self.output_specs[thread]:
            name, (_, _, offset) = spec["name"], _place(spec)
            shape = shapes.get(name)
            got[name] = (
                None
                if shape is None
                else self.shm.get_contents_as_numpy(handle, want[name].dtype, shape, offset).copy()
            )
        return got

    def close(self, wait_s: float = UNREGISTER_WAIT_S) -> None:
        """Unregister every region, waiting up to ``wait_s`` for the server to release those its last requests still
        hold, then remove them all (each one, even where another fails to unregister)."""
        left = set(self.handles)
        deadline = time.monotonic() + wait_s
        while left:
            for name in sorted(left):
                try:
                    self.client.unregister_system_shared_memory(name)
                except Exception:  # still in use by a request being released; retried below
                    log.debug("shared-memory region %s not unregistered yet", name)
            left &= self._registered()
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if left:
            log.warning("the server still holds shared-memory regions %s", ", ".join(sorted(left)))
        for handle in self.handles.values():
            self.shm.destroy_shared_memory_region(handle)
        self.handles = {}

    def _registered(self) -> set[str]:
        """Names of the system shared-memory regions the server holds (none where it cannot be asked)."""
        try:
            status = self.client.get_system_shared_memory_status()
        except Exception:  # a server gone holds nothing
            return set()
        if isinstance(status, list):  # tritonclient.http: one dict per region
            return {region["name"] for region in status}
        return set(status.regions)  # tritonclient.grpc: a message whose regions map is keyed by name


def _place(spec: dict[str, Any]) -> tuple[str, int, int]:
    """(region, byte size, offset) of a tensor :func:`~kiln.serve.http_client.shm_tensor` wrote."""
    params = spec["parameters"]
    return params["shared_memory_region"], params["shared_memory_byte_size"], params.get("shared_memory_offset", 0)


def declared_shapes(result: Any, names: list[str]) -> dict[str, list[int] | None]:
    """The shape tritonclient's ``result`` (HTTP or gRPC) declares for each output name (None: absent)."""
    shapes: dict[str, list[int] | None] = {}
    for name in names:
        meta = result.get_output(name)
        shapes[name] = None if meta is None else list(meta["shape"] if isinstance(meta, dict) else meta.shape)
    return shapes


def _triton_dtype(dtype: np.dtype) -> str:
    from tritonclient.utils import np_to_triton_dtype

    return np_to_triton_dtype(dtype)


def run_level(
    protocol: str,
    address: str,
    model: str,
    pool: list[dict],
    expected: list[dict],
    tolerance: tuple[float, float],
    concurrency: int,
    duration_s: float,
    max_requests: int,
    shared_memory: bool = False,
    switch_interval_s: float | None = CLIENT_SWITCH_S,
    client: str = "auto",
    stamped: bool = False,
) -> Level:
    """``concurrency`` client threads sending the pool's requests for ``duration_s``, every answer checked;
    ``shared_memory``: tensors through :class:`SharedMemory`, not in the requests; ``switch_interval_s``: the
    interpreter's thread switch interval while they run (:func:`sys.setswitchinterval`; None: as it is;
    :data:`CLIENT_SWITCH_S` by default); ``client``: what sends the requests (:func:`lean_client`); ``stamped``:
    each request of Kiln's client carries its send time, which Kiln's stubs time the wait before their execution
    from (:mod:`kiln.serve.stub_times`). A server that goes away stops the level (:class:`Level`'s ``server_gone``)
    rather than have its threads spin on refused connections for the rest of it."""
    module = _client_module(protocol)
    lean = lean_client(client, protocol, shared_memory)
    level, lock = Level(concurrency, client="kiln" if lean else "tritonclient"), threading.Lock()
    issued = iter(range(max_requests))  # next() under the lock: the shared request budget
    outputs = list(expected[0])
    masks = answer_masks(expected, outputs)
    scales = answer_scales(expected, masks)
    sent = pool if protocol == "ray" else [triton_feed(feed) for feed in pool]
    setup = _client(module, protocol, address)[0] if shared_memory else None
    regions = SharedMemory(module, setup, sent, expected, concurrency) if setup else None
    if lean:  # Kiln's client sends the regions' JSON (SharedMemory.input_specs)
        prepared = []
    elif regions:
        prepared = [regions.tritonclient_inputs(k) for k in range(len(pool))]
    else:
        prepared = [_inputs(module, feed, binary=protocol != "ray") for feed in sent]
    # JSON answers for Ray Serve (tritonclient.http's outputs); Triton's default (binary) otherwise
    requested = (
        {"outputs": [module.InferRequestedOutput(n, binary_data=False) for n in outputs]} if protocol == "ray" else {}
    )
    slots = iter(range(concurrency))
    start = time.perf_counter()
    deadline = start + duration_s
    gone, refused, answered_at = threading.Event(), [0], [start]  # refused: requests in a row that found no server
    halt = threading.Event()  # the level was stopped (Ctrl-C, SIGTERM): each thread ends after its request in flight

    def failed(exc: Exception) -> None:
        """Count a failed request (under the lock); enough in a row that found no server end the level."""
        said = f"{type(exc).__name__}: {exc}"
        level.errors.append(said if len(said) <= 300 else f"{said[:150]} ... {said[-145:]}")  # the cause ends it
        refused[0] = refused[0] + 1 if no_server(exc) else 0
        if refused[0]:
            level.gone_error = level.errors[-1]
        if refused[0] >= GONE_AFTER:
            level.server_gone = True
            gone.set()

    def worker() -> None:
        client, timeout = (None, {}) if lean else _client(module, protocol, address)
        http = HttpClient(address, REQUEST_TIMEOUT_S) if lean else None
        with lock:
            slot = next(slots)
        wanted = {"outputs": regions.tritonclient_outputs(slot)} if regions and not lean else requested
        made: dict[int, bytes] = {}  # the lean client's requests, made once each
        try:
            while time.perf_counter() < deadline and not gone.is_set() and not halt.is_set():
                with lock:
                    i = next(issued, None)
                if i is None:
                    return
                k = i % len(pool)
                sent = time.monotonic_ns()
                if http and (stamped or k not in made):
                    carried = {stub_times.SENT_PARAMETER: sent} if stamped else None
                    made[k] = infer_request(address, model, regions.input_specs[k], regions.output_specs[slot], carried)
                t0 = time.perf_counter()
                try:
                    result = http.send(made[k]) if http else client.infer(model, prepared[k], **timeout, **wanted)
                except Exception as exc:  # a failed request is a result of the test: count it and go on
                    with lock:
                        failed(exc)
                    continue
                done = time.perf_counter()
                ms = (done - t0) * 1e3
                err, ok, off = 0.0, True, 0.0
                if http:
                    shapes = {o["name"]: o.get("shape") for o in result.get("outputs", [])}
                    answer = regions.answer(slot, shapes, expected[k])
                else:
                    answer = regions.answer(slot, declared_shapes(result, outputs), expected[k]) if regions else None
                for name in outputs:
                    want = expected[k][name]
                    try:
                        got = answer[name] if answer is not None else result.as_numpy(name)
                    except ValueError as exc:  # e.g. an empty answer that cannot take its declared shape
                        with lock:
                            level.errors.append(f"output {name} unreadable: {exc}"[:300])
                        got = None
                    got = None if got is None else as_expected(got, want)
                    if got is None or got.shape != want.shape:
                        ok, off = False, float("inf")
                        continue
                    right, diff = answer_error(want, got, tolerance, masks[name], scales[name])
                    err, ok = worse(err, diff), ok and right
                    if not right:
                        off = worse(off, relative_error(want, got, masks[name], scales[name]))
                with lock:
                    refused[0], answered_at[0] = 0, max(answered_at[0], done)
                    level.latencies_ms.append(ms)
                    level.sent_ns.append(sent)
                    level.max_abs_err = worse(level.max_abs_err, err)
                    level.worst_wrong = worse(level.worst_wrong, off)
                    level.mismatches += not ok
        finally:
            (http or client).close()

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    try:
        # what exists now (the libraries, the pool, its expected answers) lives through the level: out of the
        # collector's sight, so no full collection walks it while requests wait
        gc.freeze()
        with switch_interval(switch_interval_s), Collections() as collections:
            level.switch_interval_s = sys.getswitchinterval()
            meter = CpuMeter()  # the threads' run only: not the imports, the regions' set-up or their release
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=duration_s + REQUEST_TIMEOUT_S + 5)  # a request in flight at the deadline may finish
            level.last_answer_s = answered_at[0] - start
            level.seconds = level.last_answer_s if level.server_gone else time.perf_counter() - start
            level.cpu = meter.read()
        level.collections = collections.seen
    except BaseException:  # stopped: the threads end before their regions go, within the client's share of the stop
        halt.set()
        joined_within(threads, HALT_WAIT_S)
        if regions:
            regions.close(STOP_WAIT_S - HALT_WAIT_S - 0.5)
            regions = None
        raise
    finally:
        gc.unfreeze()
        if regions:
            regions.close()
        if setup:
            setup.close()
    return level


def joined_within(workers: list[Any], wait_s: float) -> list[Any]:
    """Join threads or processes against one deadline ``wait_s`` away, not ``wait_s`` each; those still running."""
    deadline = time.monotonic() + wait_s
    for w in workers:
        if w.is_alive():  # a thread or process never started is not alive, and cannot be joined
            w.join(timeout=max(0.0, deadline - time.monotonic()))
    return [w for w in workers if w.is_alive()]


def end_workers(workers: list[Any], stop: bool, wait_s: float) -> None:
    """End a level's client processes: ``stop`` (the load test was stopped, or a process hangs) first sends each
    SIGTERM, which ends its level and releases its shared-memory regions (:func:`_level_worker`); all are joined
    against one deadline ``wait_s`` away, and those still running then are killed."""
    if stop:
        for w in workers:
            if w.is_alive():
                w.terminate()
    for w in joined_within(workers, wait_s):
        w.kill()
        w.join()


def answer_masks(expected: list[dict], outputs: list[str]) -> dict[str, Masks]:
    """Each output's mask fills (:func:`~kiln.core.compare.masks_of`), read from every expected answer at once: a
    single answer's few values are too few to tell a policy's -1e9 from a large value."""
    return {n: masks_of(np.concatenate([np.ravel(e[n]) for e in expected])) for n in outputs}


def answer_scales(expected: list[dict], masks: dict[str, Masks]) -> dict[str, float]:
    """Each output's typical magnitude over the expected answers: the RMS of its values compared (finite, no mask
    fill). An answer's rtol scales by this where the answer's own values are smaller (:func:`answer_error`): a
    rounding a batch brings moves an output by about as much for every sample, so a one-value output near 0 (a
    binary logit at its threshold) held to its own value would be wrong at any batch but its single one."""
    scales = {}
    for name, m in masks.items():
        r = np.concatenate([np.ravel(e[name]) for e in expected]).astype(np.float64)
        r = r[np.isfinite(r) & ~np.isin(r, m.values)]
        scales[name] = float(np.sqrt(np.mean(r**2))) if r.size else 0.0
    return scales


def answer_error(
    want: np.ndarray, got: np.ndarray, tolerance: tuple[float, float], masks: Masks, typical: float
) -> tuple[bool, float]:
    """Whether a served answer equals the engine's within ``tolerance`` (atol, rtol of the answer's scale: its
    largest expected value compared, or the output's ``typical`` magnitude where larger, :func:`answer_scales`),
    and its largest error: as validation compares (:func:`~kiln.core.compare.agrees`), the same infinity, NaN or
    mask fill in both is equal and scales nothing, and a value not finite in one only is an infinite error."""
    if not want.size:
        return True, 0.0
    err, scale = _error_and_scale(want, got, masks, typical)
    return bool(err <= tolerance[0] + tolerance[1] * scale), err


def worse(a: float, b: float) -> float:
    """The larger of two errors, NaN if either is (Python's ``max`` keeps the first where one is NaN)."""
    return float("nan") if np.isnan(a) or np.isnan(b) else max(a, b)


def no_server(exc: BaseException) -> bool:
    """Whether a failed request found no server to send it to: its connection refused or reset (tritonclient's
    HTTP client raises the socket's error; Kiln's keeps it as its error's context; tritonclient's gRPC client says
    UNAVAILABLE), or a server that has unloaded the model (:data:`UNLOADED`: a stopping server answers so until its
    port closes, and the level's first request found the model served). An error the server answered with
    otherwise, a timeout or an answer cut short (the server ending while it worked on the request) is not."""
    status = getattr(exc, "status", None)
    if callable(status) and str(status()) == "StatusCode.UNAVAILABLE":
        return True
    if UNLOADED in str(exc):
        return True
    cause = exc.__context__ if isinstance(exc, HttpError) else exc
    return isinstance(cause, ConnectionError)


def write_client_stamps(path: Path, level: Level) -> None:
    """The level's stamped requests as rows of (send time, latency) in ns, :class:`~kiln.serve.stub_times.StubStamps`'
    counterpart on the client's side."""
    rows = np.stack(
        [np.asarray(level.sent_ns, dtype=np.int64), (np.asarray(level.latencies_ms) * 1e6).astype(np.int64)]
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path, rows.T)


def lean_client(client: str, protocol: str, shared_memory: bool) -> bool:
    """Whether requests go through Kiln's HTTP client (:mod:`kiln.serve.http_client`) rather than tritonclient:
    ``client`` "kiln" or "auto" (the default) over HTTP with the tensors in shared memory, where each request is a
    small JSON whose making and parsing by tritonclient would be a share of the latency measured; "tritonclient"
    never."""
    if client not in ("auto", "kiln", "tritonclient"):
        raise ConfigError(f"client '{client}' is not one of auto, kiln, tritonclient", hint="--client auto")
    if client == "kiln" and not (protocol == "http" and shared_memory):
        raise ConfigError(
            "Kiln's own client sends HTTP requests whose tensors are in shared memory only",
            hint="add --shared-memory with an http:// URL, or --client tritonclient",
        )
    return client != "tritonclient" and protocol == "http" and shared_memory


@contextmanager
def switch_interval(seconds: float | None) -> Iterator[None]:
    """The interpreter's thread switch interval set to ``seconds`` inside the block (None: left as it is)."""
    previous = sys.getswitchinterval()
    if seconds:
        sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)


def run_level_processes(processes: int, *args: Any) -> Level:
    """:func:`run_level` over ``processes`` client processes, the level's threads and request budget split between
    them, released together once every one has imported its client library: one Python process's threads share
    its interpreter lock, and at high concurrency they, not the server, set the pace. Their results are merged."""
    import multiprocessing

    protocol, address, model, pool, expected, tolerance, concurrency, duration_s, max_requests, *rest = args
    procs = min(processes, concurrency)
    threads = [concurrency // procs + (i < concurrency % procs) for i in range(procs)]
    budgets = [max_requests // procs + (i < max_requests % procs) for i in range(procs)]
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(procs), ctx.Queue()
    workers = [
        ctx.Process(
            target=_level_worker,
            args=(barrier, results, (protocol, address, model, pool, expected, tolerance, t, duration_s, b, *rest)),
            daemon=True,
        )
        for t, b in zip(threads, budgets)
    ]
    for w in workers:
        w.start()
    merged, parts = Level(concurrency), []
    stop = True  # until every process has given its result: a stop (Ctrl-C, SIGTERM) or a hang
    try:
        for _ in workers:
            part = results.get(timeout=duration_s + REQUEST_TIMEOUT_S + 120)  # a client process that hangs
            merged.latencies_ms += part.latencies_ms
            merged.sent_ns += part.sent_ns
            parts.append(part.cpu)
            merged.collections = merged_collections(merged.collections, part.collections)
            merged.mismatches += part.mismatches
            merged.errors += part.errors
            merged.max_abs_err = worse(merged.max_abs_err, part.max_abs_err)
            merged.worst_wrong = worse(merged.worst_wrong, part.worst_wrong)
            merged.seconds = max(merged.seconds, part.seconds)
            merged.last_answer_s = max(merged.last_answer_s, part.last_answer_s)
            merged.switch_interval_s = part.switch_interval_s
            merged.client = part.client
            merged.server_gone |= part.server_gone
            merged.gone_error = merged.gone_error or (part.gone_error if part.server_gone else "")
        stop = False
    finally:
        end_workers(workers, stop, STOP_WAIT_S if stop else UNREGISTER_WAIT_S)
    merged.cpu = merged_cpu(parts)
    return merged


def merged_collections(a: dict[str, float] | None, b: dict[str, float] | None) -> dict[str, float] | None:
    """Two processes' :class:`Collections`: counts and time added, the longest pause kept."""
    if a is None or b is None:
        return a or b
    return {k: max(a[k], b[k]) if k == "longest_ms" else a[k] + b[k] for k in a}


def merged_cpu(parts: list[dict[str, float | int] | None]) -> dict[str, float | int] | None:
    """One level's CPU from its client processes' readings over nearly the same window: the machine's and the
    server's cores as their mean, the clients' as the sum of each process's own."""
    read = [p for p in parts if p]
    if not read:
        return None
    return {
        "cores": read[0]["cores"],
        "seconds": max(p["seconds"] for p in read),
        "busy": round(sum(p["busy"] for p in read) / len(read), 3),
        "server": round(sum(p["server"] for p in read) / len(read), 3),
        "clients": round(sum(p["clients"] for p in read), 3),
    }


def _level_worker(barrier: Any, results: Any, args: tuple[Any, ...]) -> None:
    """One client process of :func:`run_level_processes`: import, wait for the others, run its share. SIGTERM (its
    parent stopping it) or Ctrl-C ends its level as an interrupt does, so that :func:`run_level` releases its
    shared-memory regions on the way out; a second signal meanwhile is ignored, and the process ends quietly."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _stop_once)
    try:
        _client_module(args[0])
        barrier.wait()
        results.put(run_level(*args))
    except KeyboardInterrupt:
        pass


def _stop_once(signum: int, frame: Any) -> None:
    """The first Ctrl-C or SIGTERM as an interrupt; later ones ignored, so they do not cut the clean-up short."""
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)
    raise KeyboardInterrupt


# Triton's cumulative per-request durations (inference_stats), in the order a request meets them
TRITON_PHASES = ("queue", "compute_input", "compute_infer", "compute_output")


def server_batches(protocol: str, address: str, model: str) -> dict[str, int]:
    """Triton's own count of requests (inference_count) and of model executions (execution_count): fewer
    executions than requests means the dynamic batcher formed batches; and its cumulative nanoseconds per phase
    (``success_ns``: a request's whole time in Triton; ``<phase>_ns`` for :data:`TRITON_PHASES`). Ray Serve
    keeps no such count: its readiness is checked instead, and the counts are 0."""
    if protocol == "ray":
        return _ray_ready(address, model)
    module = _client_module(protocol)
    client = module.InferenceServerClient(address)
    try:
        stats = (
            client.get_inference_statistics(model, as_json=True)
            if protocol == "grpc"
            else client.get_inference_statistics(model)
        )
    except Exception as exc:  # tritonclient raises its own exceptions and the transport's (connection refused)
        said = f"{type(exc).__name__}: {str(exc).strip()[:200]}"
        served = served_models(client, protocol)
        if served is not None and model not in served:  # the server runs, and serves other models
            raise ConfigError(
                f"the server at {address} serves no model '{model}' ({said})",
                hint=f"--model is one of {served}" if served else "wait until `kiln serve` says it is ready",
            ) from None
        raise KilnError(
            f"cannot read model '{model}' statistics from Triton at {address} ({said})",
            hint="start the server first (`kiln serve`), check the URL's port and protocol, and that "
            "--model is a model it serves",
        ) from None
    finally:
        client.close()
    entry = stats["model_stats"][0]
    phases = entry.get("inference_stats", {})
    counts = {
        "inference_count": int(entry.get("inference_count", 0)),
        "execution_count": int(entry.get("execution_count", 0)),
        # the executions' own time, each counted once (inference_stats charge it to every request of a batch)
        "execution_ns": sum(int(b.get("compute_infer", {}).get("ns", 0)) for b in entry.get("batch_stats", [])),
    }
    return counts | {f"{k}_ns": int(phases.get(k, {}).get("ns", 0)) for k in ("success", *TRITON_PHASES)}


def served_models(client: Any, protocol: str) -> list[str] | None:
    """The models a Triton server has ready, from its repository index through tritonclient's ``client`` (HTTP or
    gRPC); None where the index cannot be read (no server there)."""
    try:
        index = (
            client.get_model_repository_index(as_json=True)
            if protocol == "grpc"
            else client.get_model_repository_index()
        )
    except Exception:  # tritonclient raises its own exceptions and the transport's (connection refused)
        return None
    entries = index.get("models", []) if isinstance(index, dict) else index
    return sorted({m["name"] for m in entries if m.get("state", "READY") == "READY"})


def server_max_batch(protocol: str, address: str, model: str) -> int | None:
    """The largest batch the server forms of ``model``'s requests: Triton's ``max_batch_size`` from the model's
    config (0: unbatched, as ``kiln serve --max-batch 0`` serves it); None where the server does not say (the Ray
    Serve application exposes no batch setting, or the config could not be read)."""
    if protocol == "ray":
        return None
    client = _client_module(protocol).InferenceServerClient(address)
    try:
        config = client.get_model_config(model, as_json=True) if protocol == "grpc" else client.get_model_config(model)
    except Exception:  # tritonclient raises its own exceptions and the transport's: the engine's limit is used
        log.debug("model '%s' config not readable from %s", model, address, exc_info=True)
        return None
    finally:
        client.close()
    config = config.get("config", config)  # gRPC's JSON wraps it; protobuf's JSON leaves out a max_batch_size of 0
    return int(config.get("max_batch_size", 0))


def batch_limit(meta: EngineMetadata, served: int | None) -> int:
    """The largest batch the server can form from single-sample requests, what the in-process timings and the
    batch-mate deviation use (0: none, every request runs alone): ``served`` (:func:`server_max_batch`) capped by
    what the engine takes, or where the server does not say, Kiln's default (:data:`CPU_MAX_BATCH`) capped so."""
    return served_max_batch(meta, CPU_MAX_BATCH if served is None else served)


def settled_batches(protocol: str, address: str, model: str, answered: int, wait_s: float = 10.0) -> dict[str, int]:
    """:func:`server_batches` once Triton has counted the ``answered`` requests: it records a request's statistics
    just after sending its response, so a read right after the last answer can miss it. Gives up after ``wait_s``
    (a request that failed may never count) and returns the last read."""
    stats = server_batches(protocol, address, model)
    deadline = time.monotonic() + wait_s
    while protocol != "ray" and stats["inference_count"] < answered and time.monotonic() < deadline:
        time.sleep(0.05)
        stats = server_batches(protocol, address, model)
    return stats


def time_split(before: dict[str, int], after: dict[str, int], client_ms: float) -> dict[str, float] | None:
    """Where a level's requests spent their time, in mean ms per request: outside Triton (the client, its
    serialising and the transport: the client's mean latency less Triton's), then Triton's phases (queue and
    dynamic batcher, input copy, the model's execution, output copy), and the mean batch Triton formed. None
    without Triton statistics (Ray Serve)."""
    done = after.get("inference_count", 0) - before.get("inference_count", 0)
    runs = after.get("execution_count", 0) - before.get("execution_count", 0)
    if done <= 0 or runs <= 0 or "success_ns" not in after:
        return None
    ms = {k: (after[f"{k}_ns"] - before[f"{k}_ns"]) / done / 1e6 for k in ("success", *TRITON_PHASES)}
    split = {"outside_triton": max(0.0, client_ms - ms["success"])}
    split |= {k: ms[k] for k in TRITON_PHASES}
    split["triton_other"] = max(0.0, ms["success"] - sum(ms[k] for k in TRITON_PHASES))
    return split | {"mean_batch": done / runs}


def stub_split(
    stub_before: dict[str, float] | None,
    stub_after: dict[str, float] | None,
    before: dict[str, int],
    after: dict[str, int],
) -> dict[str, float] | None:
    """Mean ms per execution: Triton's execution time (``execution``), the stub's phases over the executions it
    published (:func:`kiln.serve.stub_times.split`) and ``rest``, the first less the phases (the hop between Triton
    and the stub); None where the model publishes none (not Kiln's Python-backend model, a Triton without custom
    metrics); ``rest`` is None where the phases add up to more than Triton's time (not the same executions)."""
    phases = stub_times.split(stub_before, stub_after)
    runs = after.get("execution_count", 0) - before.get("execution_count", 0)
    if phases is None or runs <= 0 or "execution_ns" not in after:
        return None
    execution = (after["execution_ns"] - before.get("execution_ns", 0)) / runs / 1e6
    rest = execution - sum(phases[p] for p in stub_times.PHASES)
    # below zero, the stub's published executions are not Triton's (a metric published late): no hop to tell
    return {"execution": execution, **phases, "rest": max(rest, 0.0) if rest >= -1e-6 else None}


def _ray_ready(address: str, model: str) -> dict[str, int]:
    """The Ray Serve application answers ``model``'s readiness route, else a KilnError saying what to start."""
    import urllib.error
    import urllib.request

    url = f"http://{address}/v2/models/{model}/ready"
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            response.read()
    except (urllib.error.URLError, OSError) as exc:
        raise KilnError(
            f"the Ray Serve application for model '{model}' does not answer at {url} ({exc})",
            hint="start it with `cd package && serve run ray/serve.yaml` (check the port there), and give --model one "
            "of its applications' names",
        ) from None
    return {"inference_count": 0, "execution_count": 0}


def inprocess_ms(
    runner: Any, pool: list[dict], batch: int, budget_s: float = 2.0, buckets: list[int] | None = None
) -> dict[str, Any]:
    """The engine's own latency at ``batch`` rows of the pool, timed in this process: the figure a served request is
    compared with. Up to 50 calls after one untimed one, within ``budget_s``; ``buckets``: padded to the next of
    them, as the server runs a shape-specialised engine (:func:`padded_infer`). Its median (``latency_ms``), the
    median's 95 % interval, and whether that is too wide to compare with (``noisy``: a busy machine)."""
    rows = [pool[i % len(pool)] for i in range(batch)]
    # one request's own arrays at batch 1: an unbatched engine's may be 0-d, which take no joining
    feed = rows[0] if batch == 1 else {k: np.concatenate([r[k] for r in rows]) for k in pool[0]}
    times: list[float] = []
    padded_infer(runner, feed, buckets)
    end = time.perf_counter() + budget_s
    while len(times) < 50 and (len(times) < 5 or time.perf_counter() < end):
        t0 = time.perf_counter()
        padded_infer(runner, feed, buckets)
        times.append((time.perf_counter() - t0) * 1e3)
    ms, (lo, hi) = float(np.median(times)), median_interval(times)
    return {
        "batch": batch,
        "latency_ms": ms,
        "interval_ms": [lo, hi],
        "noisy": hi - lo > BUSY_SPREAD * ms,
        "throughput_rps": batch / ms * 1e3,
    }


def with_inprocess(levels: list[dict[str, Any]], runner: Any, pool: list[dict], limit: int) -> None:
    """Each level gets the engine's in-process latency and throughput at a batch of its concurrency (capped by
    the server's batch ``limit``: the most it can batch) and the served/in-process throughput ratio; where Triton's
    statistics give the level's mean batch, also the engine's throughput at that batch (rounded, padded as the
    server pads it) and the ratio to it: what serving costs at the batches the server really formed."""
    buckets = buckets_for(runner, limit)
    for lv in levels:
        batch = max(1, min(lv["concurrency"], limit)) if limit else 1
        own = lv["inprocess"] = inprocess_ms(runner, pool, batch, buckets=buckets)
        if own["noisy"]:
            lo, hi = own["interval_ms"]
            log.warning(
                "concurrency %d: the engine's in-process time at batch %d varied %.3f-%.3f ms (a busy machine): "
                "its served / in-process ratio means little",
                lv["concurrency"],
                batch,
                lo,
                hi,
            )
        lv["served_vs_inprocess"] = lv["throughput_rps"] / own["throughput_rps"]
        split = lv.get("server_split_ms")
        if split and split.get("mean_batch"):
            formed = max(1, min(round(split["mean_batch"]), limit or 1))
            lv["inprocess_formed"] = own if formed == batch else inprocess_ms(runner, pool, formed, buckets=buckets)
            lv["served_vs_formed"] = lv["throughput_rps"] / lv["inprocess_formed"]["throughput_rps"]


def loadtest(
    url: str,
    model: str,
    engines: str | Path,
    out: Path,
    concurrency: list[int],
    duration_s: float,
    max_requests: int = 100_000,
    config: KilnConfig | None = None,
    processes: int = 1,
    inprocess: bool = True,
    shared_memory: bool = False,
    metrics_port: int | None = 8002,
    switch_interval_s: float | None = CLIENT_SWITCH_S,
    client: str = "auto",
    stamped: bool = False,
) -> dict[str, Any]:
    """Run every concurrency level; write ``loadtest.json``, ``loadtest.md`` and ``loadtest.png`` into ``out``.
    ``processes``: client processes per level (:func:`run_level_processes`); ``inprocess``: time the engine in
    this process at each level's batch too (:func:`with_inprocess`); ``shared_memory``: tensors through system
    shared memory (:class:`SharedMemory`); ``metrics_port``: Triton's metrics port on the server's host, where Kiln's
    Python-backend models publish their executions' phases (:mod:`kiln.serve.stub_times`; None: not read);
    ``switch_interval_s``: the client processes' thread switch interval (:func:`run_level`; None: Python's);
    ``client``: what sends the requests (:func:`lean_client`); ``stamped``: requests carry their send time
    (:func:`run_level`).
    Raises :class:`GateFailure` (after writing them) if any answer was wrong or any request failed."""
    protocol, address = parse_url(url)
    if not concurrency or min(concurrency) < 1 or duration_s <= 0 or max_requests < 1:
        raise ConfigError(
            "concurrency levels must be >= 1, and duration and requests positive",
            hint="e.g. --concurrency 1,2,4,8 --duration 10",
        )
    if shared_memory and protocol == "ray":
        raise ConfigError(
            "--shared-memory needs a Triton server; the Ray Serve application takes tensors in its requests only",
            hint="drop --shared-memory for ray:// URLs",
        )
    lean_client(client, protocol, shared_memory)  # a client that cannot be used here is said before any work
    engine = engine_for(engines, model)
    pool, source = request_pool(engine, config)
    base = TOLERANCE.get(engine.meta.precision, TOLERANCE["fp16"])
    server_batches(protocol, address, model)  # a server that is not there is said before the engine loads
    limit = batch_limit(engine.meta, server_max_batch(protocol, address, model))
    host = address.rsplit(":", 1)[0]
    metrics = f"http://{host}:{metrics_port}/metrics" if metrics_port and protocol != "ray" else None
    # One load for the expected answers and the in-process timings: a torch engine compiles when it loads.
    with load_engine(engine.engine_dir) as runner:
        expected = expected_outputs(runner, pool)
        deviation = batch_deviation(runner, pool, expected, limit, base)
        tolerance = answer_band(base, deviation)
        sends = (shared_memory, switch_interval_s, client)
        first_answer(protocol, address, model, pool, expected, tolerance, *sends, engine=engine.meta.name)
        before = server_batches(protocol, address, model)  # after the first request: the levels' counts only
        levels, mark, gone = [], before, None
        for c in concurrency:
            args = (protocol, address, model, pool, expected, tolerance, c, duration_s, max_requests, *sends, stamped)
            stub = stub_times.read(metrics, model) if metrics else None
            level = run_level_processes(processes, *args) if processes > 1 and c > 1 else run_level(*args)
            levels.append(level.summary())
            if stamped:  # each request's send time and latency, for kiln.serve.stub_times.join_stamps
                write_client_stamps(out / f"stamps-c{c}.npy", level)
            if level.server_gone:  # the level stopped there: the levels measured are kept
                gone = (
                    f"the server stopped answering {level.seconds:.1f} s into the level at concurrency {c} "
                    f"({GONE_AFTER} requests in a row found no server or no model: {level.gone_error})"
                )
                after = mark
                break
            try:
                after = settled_batches(protocol, address, model, mark["inference_count"] + len(level.latencies_ms))
            except KilnError as exc:  # the server went away at the level's end
                gone, after = f"the server stopped answering during the level at concurrency {c} ({exc.message})", mark
                ended_at_last_answer(levels[-1])
                break
            levels[-1]["server_split_ms"] = time_split(mark, after, levels[-1]["latency_ms"]["mean"])
            levels[-1]["stub_ms"] = stub_split(stub, stub_times.read(metrics, model) if metrics else None, mark, after)
            mark = after
            _log_level(levels[-1])
        if inprocess:
            with_inprocess(levels, runner, pool, limit)
    batches = {k: after[k] - before[k] for k in ("inference_count", "execution_count")}
    result = {
        "url": url,
        "model": model,
        "engine": engine.meta.name,
        "precision": engine.meta.precision,
        "inputs": source,
        "request_shapes": request_shapes(pool),
        "dynamic_sizes": dynamic_sizes(engine.meta, pool),
        "tolerance": {
            "atol": tolerance[0],
            "rtol": tolerance[1],
            "base": {"atol": base[0], "rtol": base[1]},
            "batch_deviation": deviation,
            "safety": BAND_SAFETY,
        },
        "duration_s": duration_s,
        "max_requests": max_requests,
        "client_processes": processes,
        "client_switch_interval_s": levels[-1]["client_switch_interval_s"],
        "client": levels[-1]["client"],
        "transport": "system shared memory" if shared_memory else "in the requests",
        "levels": levels,
        "server": batches if protocol != "ray" else None,
        "mean_batch": batches["inference_count"] / batches["execution_count"] if batches["execution_count"] else None,
        "server_kind": "Ray Serve" if protocol == "ray" else "Triton",
    }
    write_report(result, out)
    if gone is not None:
        raise KilnError(
            f"{gone}; what was measured is in {out / 'loadtest.json'}",
            hint="keep the server running for the whole load test (kiln serve stops on Ctrl-C or SIGTERM)",
        )
    wrong = sum(lv["mismatches"] for lv in levels)
    failed = sum(lv["errors"] for lv in levels)
    worst = functools.reduce(worse, (lv["worst_wrong"] for lv in levels), 0.0)
    only_wrong = wrong and not failed  # a failed request is the server's
    cause = batching_cause(deviation, tolerance, worst, engine.meta) if only_wrong else None
    if cause:
        raise GateFailure(
            f"{wrong} answers differed from the engine's direct output under load (see {out / 'loadtest.json'}): "
            f"{cause}",
            hint=batching_hint(engines, engine, protocol),
        )
    if wrong or failed:
        raise GateFailure(
            f"{wrong} answers differed from the engine's direct output and {failed} requests failed "
            f"under load (see {out / 'loadtest.json'})",
            hint="a served answer must match the engine: check that the server serves the engine -e names (the same "
            "build, not one from another run or workdir), then the server's batching",
        )
    return result


def ended_at_last_answer(summary: dict[str, Any]) -> None:
    """Mark a level's summary as one whose server went away, found only after the level ran its full time: its
    ``seconds`` become those until its last answer and its throughput counts them, as for a level that stopped
    when the server went (:class:`Level`'s ``server_gone``)."""
    seconds = summary.get("last_answer_s") or 0.0
    summary.update(
        server_gone=True,
        seconds=seconds,
        throughput_rps=summary["requests"] / seconds if seconds else 0.0,
    )


def first_answer(
    protocol: str,
    address: str,
    model: str,
    pool: list[dict],
    expected: list[dict],
    tolerance: tuple[float, float],
    shared_memory: bool,
    switch_interval_s: float | None,
    client: str,
    engine: str,
) -> None:
    """One request alone, sent as the levels send theirs, before them: a server that refuses it (a model of another
    run whose inputs differ: "missing required input(s)") would refuse every request of every level, so that is
    said at once, quoting the server, rather than counted thousands of times."""
    args = (protocol, address, model, pool, expected, tolerance, 1, REQUEST_TIMEOUT_S, 1, shared_memory)
    probe = run_level(*args, switch_interval_s, client)
    if not probe.latencies_ms:  # no answer (one the load test finds wrong, or cannot read, is its result)
        raise KilnError(
            f"the first request to model '{model}' at {address} failed, so every request would: "
            f"{probe.errors[0] if probe.errors else 'no answer'}",
            hint=f"check that the server is running and serves the engine -e names ({engine}): point -e at the "
            "workdir or engine folder the server was started from, or --model / the URL at the server of this one",
        )


def _log_level(lv: dict[str, Any]) -> None:
    log.info(
        "concurrency %d: %.1f req/s, p50 %.2f ms, p99 %.2f ms, %d wrong, %d failed",
        lv["concurrency"],
        lv["throughput_rps"],
        lv["latency_ms"]["p50"],
        lv["latency_ms"]["p99"],
        lv["mismatches"],
        lv["errors"],
    )


def render_markdown(result: dict[str, Any]) -> str:
    lines = [
        f"# Load test: {result['model']} ({result['engine']}, {result['precision']})",
        "",
        f"{result['url']}, inputs: {result['inputs']}, up to {result['duration_s']} s or "
        f"{result['max_requests']} requests per level, single-sample requests"
        + (f" from {result['client_processes']} client processes" if result.get("client_processes", 1) > 1 else "")
        + (", tensors in system shared memory" if result.get("transport") == "system shared memory" else "")
        + (", sent by Kiln's HTTP client." if result.get("client") == "kiln" else ", sent by tritonclient."),
        *([shapes_said(result)] if result.get("request_shapes") else []),
        "",
        "| concurrency | requests | throughput (req/s) | p50 ms | p90 ms | p99 ms | in-process ms (batch) "
        "| in-process req/s | served / in-process | wrong | failed | slow in worst tenth |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for lv in result["levels"]:
        lines.append(_row(lv))
    lines += [
        f"\nConcurrency {lv['concurrency']}: the server stopped answering {lv['seconds']:.1f} s into the level, which "
        f"ended there; its throughput counts those {lv['seconds']:.1f} s, and its failed requests are those the "
        "server's end cut off or found it gone."
        for lv in result["levels"]
        if lv.get("server_gone")
    ]
    lines += [
        "",
        f"Server: {result.get('server_kind', 'Triton')}. In-process: the engine timed in this process at a batch of "
        "the level's concurrency (capped by the server's batch limit), the most a server can batch from that "
        "many single-sample requests; served / in-process compares their throughputs. Slow in worst tenth: the "
        f"share of the requests slower than p99 sent in the tenth of the level's {TAIL_WINDOW_S:g} s windows that "
        f"hold most of them (about 0.1: a tail spread over the run; near 1: stalls; -: fewer than {TAIL_MIN_SLOW} "
        "such requests, or too short a run)."
        + (
            " Noisy: the in-process time's 95 % interval was wider than a quarter of its median (a busy machine), "
            "so that ratio is no measurement of serving."
            if any((lv.get("inprocess") or {}).get("noisy") for lv in result["levels"])
            else ""
        ),
    ]
    lines += tolerance_lines(result)
    if result.get("mean_batch"):
        lines += [
            "",
            f"Server: {result['server']['inference_count']} inferences in "
            f"{result['server']['execution_count']} executions (mean batch {result['mean_batch']:.2f}).",
        ]
    return "\n".join(lines + split_table(result["levels"])) + "\n"


def tolerance_lines(result: dict[str, Any]) -> list[str]:
    """What an answer was held to (:func:`answer_band`), what batching moved the engine's own answers by, and the
    largest error the levels saw; none for a result without the measurement."""
    tol = result.get("tolerance") or {}
    deviation = tol.get("batch_deviation")
    if deviation is None:
        return []
    batches = ", ".join(map(str, deviation["batches"])) or "none (the server forms no batch)"
    seen = max((lv.get("max_abs_err", 0.0) for lv in result["levels"]), default=0.0)
    moved_said = deviation_said(deviation)
    apart = deviation.get("separation")
    cap = f"{band_cap(deviation):.3g}" + (
        f": {SEPARATION_SHARE:g} x how far apart the requests' answers lie ({apart:.3g} x their scale)"
        if apart is not None and band_cap(deviation) > BAND_CAP
        else ""
    )
    return [
        "",
        f"Wrong: off the engine's own answer by more than {tol['atol']:g} + {tol['rtol']:g} x the answer's scale "
        f"(its largest value, or its output's RMS over the requests where larger; {result['precision']}'s base "
        f"{tol['base']['atol']:g} + {tol['base']['rtol']:g}, widened to {tol['safety']:g} x the batch-mate "
        f"deviation, up to {cap}). Batch-mate deviation: the engine's answers in batches of {batches} against its "
        f"single-sample ones, {moved_said}. Largest error seen under load: {seen:.3g}.",
    ]


def deviation_said(deviation: dict[str, Any]) -> str:
    """What batching moved the engine's answers by (:func:`batch_deviation`): the rtol it adds to the base tolerance,
    or where the base covers it, that it stays within and its largest value; "none" only where nothing moved."""
    moved = max(deviation["rtol"].values(), default=0.0)
    if moved != 0:
        return f"up to {moved:.3g} x the answer's scale"
    largest = max((deviation.get("largest") or {}).values(), default=0.0)
    if largest != 0:
        return f"within the base tolerance (largest {largest:.3g} x the answer's scale)"
    atol = deviation.get("atol", 0.0)
    return f"up to {atol:.3g} in answers with no scale, none in the others" if atol != 0 else "none (identical)"


def split_table(levels: list[dict[str, Any]]) -> list[str]:
    """Mean ms per request by where it was spent (:func:`time_split`), one row per level; none without them."""
    if not any(lv.get("server_split_ms") for lv in levels):
        return []
    lines = [
        "",
        "Where a request's time went (mean ms per request; outside Triton = the client's latency less Triton's "
        "own time: the client, serialising, the transport):",
        "",
        "| concurrency | outside Triton | queue | input | execute | output | other | mean batch "
        "| in-process req/s at that batch | served / that | cores busy: machine / server / clients "
        "| clients' collections (longest ms) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for lv in levels:
        if split := lv.get("server_split_ms"):
            cells = " | ".join(f"{split[k]:.2f}" for k in ("outside_triton", *TRITON_PHASES, "triton_other"))
            formed = lv.get("inprocess_formed")
            own = (
                f"{formed['throughput_rps']:.0f} ({formed['batch']}) | {lv['served_vs_formed']:.2f}"
                if formed
                else "- | -"
            )
            cpu = lv.get("cpu_cores")
            used = f"{cpu['busy']:.1f} / {cpu['server']:.1f} / {cpu['clients']:.1f} of {cpu['cores']}" if cpu else "-"
            gc_seen = lv.get("client_collections")
            paused = f"{gc_seen['collections']} ({gc_seen['longest_ms']:.1f})" if gc_seen else "-"
            lines.append(f"| {lv['concurrency']} | {cells} | {split['mean_batch']:.2f} | {own} | {used} | {paused} |")
    return lines + stub_table(levels)


def stub_table(levels: list[dict[str, Any]]) -> list[str]:
    """Inside the model's executions (:func:`stub_split`), one row per level; none where no level has it."""
    if not any(lv.get("stub_ms") for lv in levels):
        return []
    lines = [
        "",
        "Inside an execution (mean ms per execution: Triton's time for it; the stub's own clock for reading the "
        "inputs, the engine call with its copies, and the responses, over the executions it published; rest = "
        "the hop between Triton and the stub):",
        "",
        f"| concurrency | execution | inputs | engine | responses | rest | over {stub_times.SLOW_S * 1e3:g} ms: "
        "executions (inputs / engine / responses ms each) | sent to executed: mean ms (share over "
        f"{stub_times.SLOW_S * 1e3:g} ms; end to end) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for lv in levels:
        if stub := lv.get("stub_ms"):
            cells = " | ".join(
                "-" if stub[k] is None else f"{stub[k]:.3f}" for k in ("execution", *stub_times.PHASES, "rest")
            )
            slow = f"{stub['slow_executions']:.0f}" if "slow_executions" in stub else "-"
            if stub.get("slow_ms"):
                slow += " (" + " / ".join(f"{stub['slow_ms'][p]:.1f}" for p in stub_times.PHASES) + ")"
            waited = "-"
            if "waited_ms" in stub:
                late = stub["late_requests"] / stub["stamped_requests"]
                end_to_end = lv.get("slow_requests", 0) / max(1, lv["requests"])
                waited = f"{stub['waited_ms']:.2f} ({late:.2%}; {end_to_end:.2%})"
            lines.append(f"| {lv['concurrency']} | {cells} | {slow} | {waited} |")
    return lines


def _row(lv: dict[str, Any]) -> str:
    lat, own = lv["latency_ms"], lv.get("inprocess")
    ratio = lv.get("served_vs_inprocess")
    share = (lv.get("tail_windows") or {}).get("share_in_worst_10pct")
    tail = f"{share:.2f}" if share is not None else "-"
    noisy = " (noisy)" if own and own.get("noisy") else ""
    inproc = (
        f"{own['latency_ms']:.3f} ({own['batch']}) | {own['throughput_rps']:.0f} | {ratio:.0%}{noisy}"
        if own and ratio is not None
        else "- | - | -"
    )
    stopped = " (server stopped)" if lv.get("server_gone") else ""
    return (
        f"| {lv['concurrency']} | {lv['requests']} | {lv['throughput_rps']:.1f}{stopped} | {lat['p50']:.2f} | "
        f"{lat['p90']:.2f} | {lat['p99']:.2f} | {inproc} | {lv['mismatches']} | {lv['errors']} | {tail} |"
    )


def plot(result: dict[str, Any]) -> bytes:
    import io

    import matplotlib

    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt

    levels = result["levels"]
    cs = [lv["concurrency"] for lv in levels]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(cs, [lv["throughput_rps"] for lv in levels], marker="o", label="served")
    if all("inprocess" in lv for lv in levels):
        a.plot(cs, [lv["inprocess"]["throughput_rps"] for lv in levels], marker="s", ls="--", label="in-process")
    a.set(xscale="log", yscale="log", xlabel="concurrency", ylabel="requests / s", title="throughput")
    level_ticks(a, cs)
    a.legend()
    for q in ("p50", "p90", "p99"):
        b.plot(cs, [lv["latency_ms"][q] for lv in levels], marker="o", label=q)
    b.set(xscale="log", xlabel="concurrency", ylabel="ms", title="latency")
    level_ticks(b, cs)
    b.legend()
    fig.suptitle(f"{result['model']} ({result['engine']}, {result.get('server_kind', 'Triton')})")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def level_ticks(axes: Any, levels: list[int]) -> None:
    """A log x axis ticked at the concurrency levels only, labelled as plain numbers: the log scale's own labels
    (minor ones such as 2x10^0 between close levels) overlap and name no level."""
    from matplotlib.ticker import NullLocator

    axes.set_xticks(sorted(set(levels)), labels=[str(c) for c in sorted(set(levels))])
    axes.xaxis.set_minor_locator(NullLocator())


def write_report(result: dict[str, Any], out: Path) -> None:
    write_json_atomic(out / "loadtest.json", result, sort_keys=False)
    write_text_atomic(out / "loadtest.md", render_markdown(result))
    write_bytes_atomic(out / "loadtest.png", plot(result))
