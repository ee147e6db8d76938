"""What several benchmark scripts share: the bare loop's update, CUDA-graphed calls and how a result is written.

One definition of the bare loop's update, so that every benchmark comparing Kiln's loop with "the bare loop"
(``train_bench.py``, ``step_host_cost.py``, ``train_loop_ab.py``) compares it with the same code.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn


def bare_update(scaler: torch.amp.GradScaler, opt: torch.optim.Optimizer, params: list[nn.Parameter]) -> None:
    """Everything after the backward pass in the bare AMP loop: unscale, clip to norm 1.0, (scaled) step, scaler
    update, zero_grad(set_to_none)."""
    scaler.unscale_(opt)
    nn.utils.clip_grad_norm_(params, 1.0)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)


def write_report(out: Path, stem: str, result: dict[str, Any], markdown: str) -> None:
    """``<out>/<stem>.json`` and ``<out>/<stem>.md`` (``out`` made where missing), and the Markdown on stdout."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"{stem}.md").write_text(markdown)
    print(markdown)


def graphed(fn: Callable[[], Any], calls: int) -> torch.cuda.CUDAGraph:
    """``calls`` calls of ``fn`` as one CUDA graph, warmed on a side stream first: replaying it times the GPU's
    work, not Python's launches (kernels of a few microseconds launched one by one from Python measure the launch
    rate instead)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph
