"""Where a served request's time went, one request at a time: Triton's own trace (``kiln serve --trace``).

Triton stamps a sample of requests (every ``rate``-th) at each step: received, queued, its batch's compute
started, inputs in, outputs out, done, answer sent. Triton's statistics give these phases as means; a latency
tail needs them per request, to see in which phase the slow requests lost their time. Triton writes the file
when it stops; :func:`read` groups its records by request (the protocol's and the core's stamps of one request
come as separate records with the same id) and :func:`summary` gives each phase's percentiles and its mean among
the slowest requests.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

# (phase, from, to): the first stamp of ``from`` a request has, to the first of ``to``; HTTP or gRPC stamps at the
# ends, the core's in between
ARRIVED = ("HTTP_RECV_START", "GRPC_WAITREAD_END", "REQUEST_START")
SENT = ("HTTP_SEND_END", "GRPC_SEND_END", "REQUEST_END")
PHASES = (
    ("before queue", ARRIVED, ("QUEUE_START",)),
    ("queue", ("QUEUE_START",), ("COMPUTE_START",)),
    ("input", ("COMPUTE_START",), ("COMPUTE_INPUT_END",)),
    ("infer", ("COMPUTE_INPUT_END",), ("COMPUTE_OUTPUT_START",)),
    ("output", ("COMPUTE_OUTPUT_START",), ("COMPUTE_END",)),
    ("after compute", ("COMPUTE_END",), SENT),
    ("total", ARRIVED, SENT),
)


def trace_args(file: Path, rate: int) -> list[str]:
    """``tritonserver`` arguments that stamp every ``rate``-th request and write them all to ``file`` as it stops."""
    return [
        f"--trace-config=triton,file={file}",
        "--trace-config=triton,log-frequency=0",
        f"--trace-config=rate={rate}",
        "--trace-config=level=TIMESTAMPS",
    ]


def read(file: Path) -> list[dict[str, int]]:
    """Each traced request's stamps (name -> ns), in the order Triton wrote them; requests without the core's
    stamps (a request refused before it reached a model) are left out."""
    records = json.loads(file.read_text() or "[]")
    stamps: dict[Any, dict[str, int]] = {}
    for record in records:
        request = stamps.setdefault(record.get("id"), {})
        for stamp in record.get("timestamps", []):
            request.setdefault(stamp["name"], int(stamp["ns"]))
    return [s for s in stamps.values() if "QUEUE_START" in s and "COMPUTE_END" in s]


def durations(request: dict[str, int]) -> dict[str, float]:
    """ms per phase of one request (a phase whose stamps it lacks is left out)."""
    out = {}
    for name, start, end in PHASES:
        first = next((request[s] for s in start if s in request), None)
        last = next((request[s] for s in end if s in request), None)
        if first is not None and last is not None:
            out[name] = (last - first) / 1e6
    return out


def summary(requests: list[dict[str, int]], slowest: float = 0.01) -> dict[str, Any] | None:
    """Per phase: p50 / p90 / p99 ms over the traced requests, and the mean ms of the ``slowest`` share of them
    (by total): the phase that grows there is where the tail comes from. None without requests."""
    rows = [durations(r) for r in requests]
    rows = [r for r in rows if "total" in r]
    if not rows:
        return None
    total = np.asarray([r["total"] for r in rows])
    cut = np.quantile(total, 1 - slowest)
    slow = [r for r in rows if r["total"] >= cut]
    phases = {}
    for name, *_ in PHASES:
        values = np.asarray([r[name] for r in rows if name in r])
        p50, p90, p99 = np.percentile(values, [50, 90, 99])
        phases[name] = {
            "p50": float(p50),
            "p90": float(p90),
            "p99": float(p99),
            "slowest_mean": float(np.mean([r[name] for r in slow if name in r])),
        }
    return {"requests": len(rows), "slowest": len(slow), "phases": phases}


def markdown(found: dict[str, Any]) -> list[str]:
    """The summary as a table, one row per phase."""
    lines = [
        f"Triton's trace: {found['requests']} requests stamped; the slowest {found['slowest']} of them by total.",
        "",
        "| phase | p50 ms | p90 ms | p99 ms | mean ms in the slowest |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, p in found["phases"].items():
        lines.append(f"| {name} | {p['p50']:.2f} | {p['p90']:.2f} | {p['p99']:.2f} | {p['slowest_mean']:.2f} |")
    return lines
