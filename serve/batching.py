"""Batches as a shape-specialised engine wants them, for both servers (``kiln serve``'s PyTriton models and the
Python-backend repository of ``kiln serve --gpus``): engines that build a session or compile and capture a CUDA
graph per input shape (``per_shape_sessions``: ONNX Runtime CUDA, the torch engine's compiled flavour) are run at a
few batch sizes only, 1, 2, 4, ... up to the largest, each built before the server says ready. Without it every new
batch size the dynamic batcher forms costs a build while requests wait."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from kiln.core.errors import InputError

COPY_THREADS = 4  # threads that copy a large batch's rows into the engine's buffer (numpy copies release the GIL)
PARALLEL_COPY_BYTES = 16 << 20  # smaller batches are copied by one thread: handing shares out costs more than it saves

_copiers: dict[int, ThreadPoolExecutor] = {}


# ONNX Runtime's error for an argument it refuses (its status INVALID_ARGUMENT): by the class, as the module and name
# its bindings give it, and by the message it starts (a build whose bindings raise another class)
ORT_INVALID_ARGUMENT = ("onnxruntime.capi.onnxruntime_pybind11_state", "InvalidArgument")
ORT_INVALID_MESSAGE = "[ONNXRuntimeError] : 2 : INVALID_ARGUMENT"


def request_fault(exc: BaseException) -> bool:
    """Whether the engine's exception on a request is the request's own fault, answered as the client's error
    (HTTP 400), not the server's (500): Kiln's :class:`InputError` (the engine's check of its inputs), or ONNX
    Runtime's INVALID_ARGUMENT, which it raises for inputs it cannot run (an index past a Gather's table, a rank or
    a size its graph does not take). Told by the class's name, so a server of another backend imports no ONNX
    Runtime."""
    kind = type(exc)
    ort = (kind.__module__, kind.__qualname__) == ORT_INVALID_ARGUMENT or str(exc).startswith(ORT_INVALID_MESSAGE)
    return ort or isinstance(exc, InputError)


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, ... up to ``max_batch`` (included): the batch sizes a shape-specialised engine is run at."""
    sizes = [1 << i for i in range(max_batch.bit_length()) if 1 << i < max_batch]
    return [*sizes, max_batch]


def pad_rows(inputs: dict[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
    """Each input grown to ``rows`` rows by repeating its last row (rows are independent at inference)."""
    return {
        k: np.concatenate([v, np.repeat(v[-1:], rows - len(v), axis=0)]) if rows > len(v) else v
        for k, v in inputs.items()
    }


def buckets_for(runner: Any, max_batch: int) -> list[int] | None:
    """The sizes to pad to for ``runner`` served with batches of up to ``max_batch`` rows; None: any size runs as
    it comes (an engine with one program for every shape, or a model served without a batch axis)."""
    return batch_buckets(max_batch) if max_batch > 0 and getattr(runner, "per_shape_sessions", False) else None


def padded_infer(runner: Any, inputs: dict[str, np.ndarray], buckets: list[int] | None) -> dict[str, Any]:
    """``runner.infer`` on ``inputs`` padded to the next bucket, outputs cut back to the rows asked for."""
    if not buckets:
        return runner.infer(inputs)
    rows = len(next(iter(inputs.values())))
    size = next((b for b in buckets if b >= rows), rows)
    result = runner.infer(pad_rows(inputs, size))
    return {name: value[:rows] for name, value in result.items()} if size != rows else result


def batched_infer(
    runner: Any, feeds: list[dict[str, np.ndarray]], buckets: list[int] | None, threads: int = COPY_THREADS
) -> list[dict[str, np.ndarray]]:
    """One engine call for several requests' feeds (each with its own batch axis), each request's rows of every
    output back. The rows go straight into the runner's kept host buffers for the padded batch
    (:meth:`~kiln.stages.engines.backend.Runner.host_inputs`: one copy per request, none for joining or padding,
    and for a GPU engine an upload from page-locked memory). Requests whose other dimensions differ cannot
    share a batch (Triton's batcher never joins them): a ValueError, rather than rows broadcast into the buffer.
    A batch of :data:`PARALLEL_COPY_BYTES` or more is copied by up to ``threads`` threads: one thread's copy into
    page-locked memory moves a few GB/s, so at a batch of 32 images it would take longer than the engine."""
    names = list(feeds[0])
    sizes = [len(f[names[0]]) for f in feeds]
    rows = sum(sizes)
    size = next((b for b in buckets if b >= rows), rows) if buckets else rows
    tails = {n: {f[n].shape[1:] for f in feeds} for n in names}
    mixed = sorted(n for n, t in tails.items() if len(t) > 1)
    if mixed:
        raise ValueError(f"requests of one batch differ in the shape of {mixed} beyond the batch axis")
    host = runner.host_inputs({n: (size, *tails[n].pop()) for n in names})
    for n in names:
        _fill(host[n], [f[n] for f in feeds], rows, threads)
    out = runner.infer(host)
    bounds = np.cumsum(sizes)[:-1]
    parts = {n: np.split(np.asarray(v)[:rows], bounds) for n, v in out.items()}
    return [{n: parts[n][i] for n in out} for i in range(len(feeds))]


def _fill(target: np.ndarray, parts: list[np.ndarray], rows: int, threads: int = 1) -> None:
    """``parts`` one after the other into ``target``'s first ``rows`` rows, the last row repeated after them; with
    ``threads`` > 1 and :data:`PARALLEL_COPY_BYTES` or more of rows to copy, in about equal shares of rows at once."""
    pieces, at = [], 0
    for part in parts:
        pieces.append((at, part))
        at += len(part)
    if threads > 1 and target[:rows].nbytes >= PARALLEL_COPY_BYTES and rows > 1:
        step = -(-rows // threads)  # rows per share; a request's rows may be split between shares
        shares = [_cut(pieces, lo, lo + step) for lo in range(0, rows, step)]
        pool = _copiers.get(threads) or _copiers.setdefault(threads, ThreadPoolExecutor(threads, "kiln-copy"))
        # every share finished before the buffer is used or an error is raised: none still writing into the next batch
        done, _ = wait([pool.submit(_copy, target, share) for share in shares])
        for future in done:
            future.result()
    else:
        _copy(target, pieces)
    target[rows:] = target[rows - 1]


def _cut(pieces: list[tuple[int, np.ndarray]], lo: int, hi: int) -> list[tuple[int, np.ndarray]]:
    """The parts of ``pieces`` (start row, rows) that fall in rows ``lo`` to ``hi``, cut to them."""
    out = []
    for at, part in pieces:
        a, b = max(at, lo), min(at + len(part), hi)
        if a < b:
            out.append((a, part[a - at : b - at]))
    return out


def _copy(target: np.ndarray, pieces: list[tuple[int, np.ndarray]]) -> None:
    for at, part in pieces:
        target[at : at + len(part)] = part


def warm_buckets(runner: Any, meta: Any, buckets: list[int]) -> bool:
    """Build the engine's per-shape sessions for every bucket before the server says ready. Only for inputs whose
    other dimensions are fixed (a dynamic sequence axis has no one size to warm)."""
    if any(not all(isinstance(d, int) and d > 0 for d in s.shape[1:]) for s in meta.inputs):
        return False
    for size in buckets:
        runner.infer({s.name: np.zeros((size, *s.shape[1:]), dtype=np.dtype(s.dtype)) for s in meta.inputs})
    return True
