"""PyTorch's CPU threads on a machine that other work keeps busy.

An operator that runs on several threads ends only when every one of them has run. On a machine whose cores are
taken by other processes, each thread beyond the first waits for a time slice at every operator, so a small model
trains many times slower on two threads than on one. Kiln therefore gives PyTorch only the cores the load leaves
idle, at least one, when the user has not chosen (``OMP_NUM_THREADS``)."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger("kiln.core.threads")

# PyTorch's own thread count while cpu_threads_for_load has lowered it (None: not lowered), for lowered_from
_lowered_from: int | None = None
# Inside cpu_threads_for_load's block where Kiln chose the count: (cores, PyTorch's own count, the block's first
# count), for follow_load; None outside one and where the user chose (OMP_NUM_THREADS)
_chosen: tuple[int, int, int] | None = None


def threads_for_load(cores: int, load: float, current: int) -> int:
    """Intra-op threads for a machine of ``cores`` at a 1-minute ``load`` average: the cores the load leaves idle
    (rounded up: a load that only lingers from a finished command costs no core), at least one, never more than
    ``current`` (PyTorch's own choice)."""
    return max(1, min(current, math.ceil(cores - load)))


@contextmanager
def cpu_threads_for_load(say: bool = True) -> Iterator[int | None]:
    """PyTorch's intra-op threads set by :func:`threads_for_load` for the block (said when lowered, unless ``say``
    is false), then restored: a caller's own process (a notebook) keeps its setting. Yields the count, or None when
    the user set ``OMP_NUM_THREADS`` (their choice stands)."""
    if os.environ.get("OMP_NUM_THREADS"):
        yield None
        return
    import torch

    cores, load, current = len(os.sched_getaffinity(0)), os.getloadavg()[0], torch.get_num_threads()
    global _lowered_from, _chosen
    threads = threads_for_load(cores, load, current)
    if threads < current:
        torch.set_num_threads(threads)
        _lowered_from = current
        (log.info if say else log.debug)(
            "busy machine (load average %.1f on %d cores): PyTorch runs on %d thread(s); OMP_NUM_THREADS chooses",
            load,
            cores,
            threads,
        )
    _chosen = (cores, current, threads)
    try:
        yield threads
    finally:
        torch.set_num_threads(current)
        _lowered_from = _chosen = None


def follow_load() -> int | None:
    """Inside :func:`cpu_threads_for_load`'s block, PyTorch's intra-op threads set again for the load now, never
    above the block's first count: a long loop (training epochs) that began on an idle machine keeps up with other
    work that starts later. Costs one ``getloadavg`` where the count stays. Returns the count, or None outside such
    a block or where the user chose (``OMP_NUM_THREADS``): then nothing changes."""
    if _chosen is None:
        return None
    import torch

    global _lowered_from
    cores, own, first = _chosen
    load = os.getloadavg()[0]
    threads = threads_for_load(cores, load, first)
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
        _lowered_from = own if threads < own else None
        log.debug("load average now %.1f on %d cores: PyTorch runs on %d thread(s)", load, cores, threads)
    return threads


def lowered_from() -> int | None:
    """PyTorch's own thread count where :func:`cpu_threads_for_load` (or :func:`follow_load`) lowered it for the load
    now; None where nothing is lowered."""
    return _lowered_from
