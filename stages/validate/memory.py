"""Peak memory of an engine or a PyTorch baseline, measured the same way for both on one device.

No library reports one number for "what did running this cost" across ONNX Runtime, TensorRT and PyTorch: ORT's
CUDA arena and TensorRT allocate outside PyTorch's allocator, so ``torch.cuda.max_memory_allocated`` cannot see
them. What is measured instead, by sampling in a thread while the work runs:

- CPU: the larger of two growths over the value before loading: the process's resident set size (psutil), and
  the C heap in use (glibc's ``mallinfo2``, every thread's arena and mmapped blocks). A process that already
  trained and built reuses the heap it freed, so its RSS need not grow while an engine allocates; the heap in use
  does. Without glibc, RSS alone.
- CUDA: device memory in use (``torch.cuda.mem_get_info``: total - free), peak minus the value before loading.
  Device-wide: another process allocating at the same time is counted too; PyTorch's cache is emptied first.

No growth, or without heap statistics one below :data:`UNSEEN_MB`, means the meter did not see the work's memory
(reused pages), not that it took none: ``peak_mb`` is then None, reported as not measured. Sampling every
``interval`` seconds misses allocations that live shorter than that; reported as ``method``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil

INTERVAL_S = 0.002
UNSEEN_MB = 0.05  # an RSS growth below this is page noise, not the work's memory


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2``: ten ``size_t`` counters."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    ]


@functools.cache
def heap_reader() -> Callable[[], int] | None:
    """Bytes of C heap in use (allocated chunks plus mmapped blocks, all arenas), or None without glibc 2.33+."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallinfo2 = libc.mallinfo2
    except (OSError, AttributeError):  # not glibc, or one older than mallinfo2
        return None
    mallinfo2.restype, mallinfo2.argtypes = _MallInfo2, []

    def in_use() -> int:
        info = mallinfo2()
        return info.uordblks + info.hblkhd

    return in_use


def _meters(device: str) -> list[Callable[[], int]]:
    """What to sample on ``device``: each a byte count whose growth is the work's memory."""
    if device == "cuda":
        import torch

        def cuda_used() -> int:
            free, total = torch.cuda.mem_get_info()
            return total - free

        return [cuda_used]
    proc = psutil.Process()
    heap = heap_reader()
    return [lambda: proc.memory_info().rss, *([heap] if heap else [])]


METHODS = {
    "cpu": "the larger of process RSS and C heap in use (glibc mallinfo2), peak - before, sampled every 2 ms",
    "cuda": "device memory in use peak - before (torch.cuda.mem_get_info, sampled every 2 ms, device-wide)",
}
RSS_ONLY = "process RSS peak - before (psutil, sampled every 2 ms; no heap statistics without glibc)"


class PeakMemory:
    """``with PeakMemory("cuda") as m: ...`` then ``m.peak_mb``: None when the device cannot be read or the meter
    saw no growth (``method`` then says why)."""

    def __init__(self, device: str, interval: float = INTERVAL_S) -> None:
        self.device, self.interval = device, interval
        self.method = METHODS.get(device, "") if device == "cuda" or heap_reader() else RSS_ONLY
        self.peak_mb: float | None = None
        self._stop = threading.Event()
        self._meters: list[Callable[[], int]] = []

    def __enter__(self) -> PeakMemory:
        if self.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                return self
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # PyTorch's cached blocks from earlier work would hide this work's growth
        self._meters = _meters(self.device)
        self._start = [m() for m in self._meters]
        self._peak = list(self._start)
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self._take()

    def _take(self) -> None:
        self._peak = [max(p, m()) for p, m in zip(self._peak, self._meters)]

    def __exit__(self, *exc: Any) -> None:
        if not self._meters:
            return
        self._stop.set()
        self._thread.join()
        self._take()
        grown = max(p - s for p, s in zip(self._peak, self._start)) / 2**20
        sees_every_allocation = self.device == "cpu" and len(self._meters) > 1  # the heap meter counts each malloc
        if grown <= 0 or (grown < UNSEEN_MB and not sees_every_allocation):
            self.method = f"not measured: no growth seen ({self.method})"
            return
        self.peak_mb = float(f"{grown:.3g}")  # a small model's 0.02 MB stays 0.02, not 0.0


def wait_a_sample(interval: float = INTERVAL_S) -> None:
    """Let the sampler see memory that the caller is about to free (the peak of a short run)."""
    time.sleep(3 * interval)
