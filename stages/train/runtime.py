"""Process-wide switches the loop turns on for its duration: determinism and the profiler."""

from __future__ import annotations

import logging
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("kiln.train")
SKIPPED = 2  # profiler steps before the trace: 1 waited, 1 warm-up
# What the profiler's C++ library (kineto) prints on stderr as it starts and stops, whatever the log level or -q
KINETO_NOISE = re.compile(r"(USDT|STAGE):\S+ \S+ \d+:\d+ \w+\.cpp:\d+\] ")


@contextmanager
def determinism(deterministic: bool, device: torch.device) -> Iterator[None]:
    """deterministic: torch's deterministic algorithms and no cuDNN autotuning (bit-identical reruns on one
    machine, some speed lost). Otherwise cuDNN autotunes convolutions. Global flags are restored on exit,
    since later stages run in the same process."""
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.backends.cudnn.benchmark,
        torch.backends.cudnn.deterministic,
    )
    if deterministic:
        # cuBLAS needs this to be deterministic; it only takes effect if set before cuBLAS initialises.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = False, True
    elif device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0])
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = saved[1], saved[2]


class _NoProfiler:
    def step(self) -> None:
        pass


@contextmanager
def profiler(steps: int, device: torch.device, out_dir: Path | None) -> Iterator[Any]:
    """A torch.profiler over ``steps`` optimizer steps (after 1 skipped and 1 warm-up step), written as a
    Chrome trace ``trace.json`` (opens in Perfetto, chrome://tracing and TensorBoard's profiler plugin)."""
    if steps <= 0 or out_dir is None:
        yield _NoProfiler()
        return
    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    trace = out_dir / "trace.json"

    def write(prof: Any) -> None:
        prof.export_chrome_trace(str(trace))
        # A run shorter than the schedule ends the trace early: say how many steps it really holds.
        got = max(0, min(steps, prof.step_num - SKIPPED))
        if got < steps:
            log.warning(
                "profiler trace of %d steps, not %d: the run has only %d steps (the first %d are not recorded): "
                "trace.json in the train stage's folder",
                got,
                steps,
                prof.step_num,
                SKIPPED,
            )
        else:
            log.info("profiler trace of %d steps: trace.json in the train stage's folder", got)

    prof = profile(
        activities=activities,
        schedule=schedule(wait=1, warmup=SKIPPED - 1, active=steps, repeat=1),
        on_trace_ready=write,
        record_shapes=True,
    )
    with stderr_without(KINETO_NOISE):
        prof.__enter__()
    try:
        yield _QuietSteps(prof, last=SKIPPED + steps)
    finally:
        with stderr_without(KINETO_NOISE):
            prof.__exit__(*sys.exc_info())


class _QuietSteps:
    """``prof.step()`` with kineto's start and stop lines dropped from stderr, up to the step that ends the trace;
    anything else written there meanwhile is written after the step."""

    def __init__(self, prof: Any, last: int) -> None:
        self.prof, self.last = prof, last

    def step(self) -> None:
        if self.prof.step_num > self.last:
            self.prof.step()
            return
        with stderr_without(KINETO_NOISE):
            self.prof.step()


@contextmanager
def stderr_without(noise: re.Pattern[str]) -> Iterator[None]:
    """Run the block with file descriptor 2 (C++ libraries write there directly) going to a temporary file, then
    write what it caught back to stderr but for the lines ``noise`` matches."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = [
                line
                for line in caught.read().splitlines(keepends=True)
                if not noise.match(line.decode("utf-8", "replace"))
            ]
            if kept:
                os.write(2, b"".join(kept))
