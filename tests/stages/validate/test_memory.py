"""PeakMemory on the CPU sees what the measured work allocates, also where the process reuses heap it freed (RSS
then does not grow), and says "not measured" instead of 0.0 MB when it saw nothing."""

from __future__ import annotations

import gc
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from kiln.core.records import Baseline, EngineValidation, Memory, ValidationResult
from kiln.stages.validate import memory
from kiln.stages.validate.memory import PeakMemory, heap_reader
from kiln.stages.validate.report import report_section

pytestmark = pytest.mark.skipif(heap_reader() is None, reason="needs glibc's mallinfo2")
MB = 2**20


PINS: list[bytearray] = []


def churn(total_mb: int = 48, block: int = 64 * 1024) -> None:
    """Allocate and free ``total_mb`` of heap in blocks below the mmap threshold, with a block allocated after them
    kept: the heap cannot shrink past it, so the freed memory stays resident, as in a process that trained."""
    blocks = [bytearray(block) for _ in range(total_mb * MB // block)]
    PINS.append(bytearray(block))
    del blocks
    gc.collect()


def bytearrays(mb: int) -> Callable[[], object]:
    return lambda: [bytearray(64 * 1024) for _ in range(mb * MB // (64 * 1024))]


def numpy_arrays(mb: int) -> Callable[[], object]:
    return lambda: [np.ones(8 * 1024) for _ in range(mb * MB // (64 * 1024))]  # 64 KB each


def ort_session(tmp: Path) -> Callable[[], object]:
    from kiln.core.onnx_io import ort_run, ort_session
    from kiln.models.registry import build_model
    from kiln.stages.export.torch_export import export_onnx

    export_onnx(build_model("cnn"), torch.rand(2, 1, 8, 8), tmp / "m.onnx")

    def run() -> object:
        sess = ort_session(tmp / "m.onnx")
        return sess, ort_run(sess, {"input": np.random.rand(256, 1, 8, 8).astype(np.float32)})

    return run


@pytest.mark.parametrize(
    "make,least_mb",
    [(bytearrays(16), 15), (numpy_arrays(16), 15), (bytearrays(4), 3.5), ("ort", 0.5)],
    ids=["bytearrays-16MB", "numpy-16MB", "bytearrays-4MB", "onnxruntime-session"],
)
def test_work_that_reuses_freed_heap_is_measured(tmp_path: Path, make: object, least_mb: float) -> None:
    work = ort_session(tmp_path) if make == "ort" else make
    churn()
    with PeakMemory("cpu") as mem:
        kept = work()
    assert mem.peak_mb is not None and mem.peak_mb >= least_mb, (mem.peak_mb, mem.method)
    assert "mallinfo2" in mem.method
    del kept


@pytest.mark.parametrize("meters", ["rss-only", "heap-blind"])
def test_growth_the_meter_cannot_see_is_not_measured_not_zero(monkeypatch: pytest.MonkeyPatch, meters: str) -> None:
    flat = lambda: 1 << 30  # noqa: E731 - a meter that never moves: the work's memory went unseen
    monkeypatch.setattr(memory, "_meters", lambda device: [flat] if meters == "rss-only" else [flat, flat])
    with PeakMemory("cpu") as mem:
        kept = bytearrays(4)()
    assert mem.peak_mb is None and mem.method.startswith("not measured")
    del kept


def test_the_report_says_not_measured_for_a_peak_it_has_not() -> None:
    engine = EngineValidation(
        name="e", backend="onnxruntime", precision="fp32", device="cpu", status="validated", passed=True
    )
    engine.memory = Memory(peak_mb=None, method="not measured: no growth seen", size_bytes=10)
    v = ValidationResult(
        passed=True, baseline=Baseline(accuracy=None, samples=1, latency_ms={}), engines=[engine], failures=[]
    )
    lines = report_section(v)
    row = next(line for line in lines[lines.index("### Memory") :] if line.startswith("| e |"))
    assert row.split("|")[2].strip() == "not measured"


SMALL = """
import sys
from kiln.stages.validate.memory import PeakMemory
with PeakMemory("cpu") as mem:
    kept = bytearray(int(sys.argv[1]) * 1024)
print(mem.peak_mb, mem.method)
"""


@pytest.mark.parametrize("kb", [8, 20, 40])
def test_a_small_allocation_the_heap_meter_sees_is_not_rounded_to_zero(kb: int) -> None:
    """In a process of its own: the heap meter counts every thread's allocations, and a test runner's own threads
    (pytest-xdist's channel to its controller) free kilobytes while the block is measured."""
    out = subprocess.run([sys.executable, "-c", SMALL, str(kb)], capture_output=True, text=True, check=True).stdout
    peak, method = out.split(" ", 1)
    assert peak != "None" and kb / 1024 * 0.9 <= float(peak), out
