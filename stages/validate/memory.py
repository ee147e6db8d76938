"""Peak memory of an engine or a PyTorch baseline, measured the same way for both on one device.

No library reports one number for "what did running this cost" across ONNX Runtime, TensorRT and PyTorch: ORT's
CUDA arena and TensorRT allocate outside PyTorch's allocator, so ``torch.cuda.max_memory_allocated`` cannot see
them. What is measured instead, by sampling in a thread while the work runs:

- CPU: the process's resident set size (psutil), peak minus the value before loading.
- CUDA: device memory in use (``torch.cuda.mem_get_info``: total - free), peak minus the value before loading.
  Device-wide: another process allocating at the same time is counted too; PyTorch's cache is emptied first.

Sampling every ``interval`` seconds misses allocations that live shorter than that; reported as ``method``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import psutil

INTERVAL_S = 0.002


def _used(device: str) -> Callable[[], int]:
    if device == "cuda":
        import torch

        def cuda_used() -> int:
            free, total = torch.cuda.mem_get_info()
            return total - free

        return cuda_used
    proc = psutil.Process()
    return lambda: proc.memory_info().rss


METHODS = {
    "cpu": "process RSS peak - before (psutil, sampled every 2 ms)",
    "cuda": "device memory in use peak - before (torch.cuda.mem_get_info, sampled every 2 ms, device-wide)",
}


class PeakMemory:
    """``with PeakMemory("cuda") as m: ...`` then ``m.peak_mb`` (None when the device cannot be read)."""

    def __init__(self, device: str, interval: float = INTERVAL_S) -> None:
        self.device, self.interval, self.method = device, interval, METHODS.get(device, "")
        self.peak_mb: float | None = None
        self._stop = threading.Event()
        self._peak = 0

    def __enter__(self) -> PeakMemory:
        if self.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                self._used = None
                return self
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # PyTorch's cached blocks from earlier work would hide this work's growth
        self._used = _used(self.device)
        self._start = self._peak = self._used()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self._peak = max(self._peak, self._used())

    def __exit__(self, *exc: Any) -> None:
        if self._used is None:
            return
        self._stop.set()
        self._thread.join()
        self._peak = max(self._peak, self._used())
        self.peak_mb = round((self._peak - self._start) / 2**20, 2)


def wait_a_sample(interval: float = INTERVAL_S) -> None:
    """Let the sampler see memory that the caller is about to free (the peak of a short run)."""
    time.sleep(3 * interval)
