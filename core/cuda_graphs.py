"""One helper for capturing work as a CUDA graph, shared by the training step check and the torch engine.

``torch.cuda.graph`` is the library's capture API; what this adds is the order its documentation asks for and two
details both callers need: the work runs a few times on a side stream first (lazy initialisation, compilation,
autotuning and cuDNN's algorithm search must not happen inside a capture), and the capture runs on that stream of
the tensors' own GPU (``torch.cuda.graph`` otherwise uses one process-wide stream made on whichever GPU was current
at the first capture) in ``thread_local`` mode, so another thread's CUDA calls (Kiln's peak-memory sampler polls
``cudaMemGetInfo`` during validation) cannot invalidate it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def capture(work: Callable[[], Any], device: torch.device, warmups: int = 1) -> tuple[torch.cuda.CUDAGraph, Any]:
    """``(graph, output)``: ``work`` run ``warmups`` times, then captured; replaying the graph redoes it on the same
    tensors and rewrites ``output`` in place. Raises what the capture raises (e.g. work that synchronises)."""
    import torch  # lazily: the engines' modules import this one without needing torch

    with torch.cuda.device(device):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmups):
                work()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            out = work()
        torch.cuda.current_stream().wait_stream(stream)
    return graph, out
