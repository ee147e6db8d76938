"""Where a Python-backend stub's executions go, on the stub's own clock: reading the requests' inputs, the engine
call (the batch assembled, copied to the engine's device and back, split), building the responses. Triton times
an execution whole (``compute_infer``); what it spends beyond these phases is the hop between Triton and the stub
(shared-memory messages, the stub's wake-up) and the backend's own copies.

Executions whose phases add up to more than :data:`SLOW_S` are counted apart, with those phases' seconds
(``kiln_stub_slow_seconds_total{model, phase}``): a latency tail made of a few slow executions shows which phase
stalled.

Where the server's environment names a folder in :data:`STAMPS_ENV` (a diagnosis: every request's parameters are
read), a request that carries its send time (the request parameter :data:`SENT_PARAMETER`, ns of the host's
monotonic clock, which ``kiln loadtest`` adds when asked) is also timed from there to the start of its execution:
the HTTP frontend, Triton's queue, its input copy and the hop to the stub. Its requests that waited over :data:`SLOW_S`
against the client's requests over it say whether a tail forms before the stub or after it.

The stub publishes its sums as Triton custom metrics (``kiln_stub_seconds_total{model, phase}``,
``kiln_stub_executions_total{model}``, ``kiln_stub_requests_total{model}``, the slow executions' two) on Triton's
Prometheus endpoint, which
``kiln loadtest`` reads before and after each level. Each update of a custom metric is a message to the Triton
process, so the stub adds up its timings and publishes them at most every ``KILN_STUB_METRICS_S`` seconds (default
1): the averages cover the executions published, a sample of the level's."""

from __future__ import annotations

import json
import os
import re
import time
import urllib.request
from pathlib import Path
from typing import Any

PHASES = ("inputs", "engine", "responses")
SLOW_PHASES = tuple(f"{p}_slow" for p in PHASES)  # the same phases over the slow executions only (read()'s keys)
SLOW_S = 0.010  # an execution whose phases add up to more than this is counted as slow
SECONDS = "kiln_stub_seconds_total"
SLOW_SECONDS = "kiln_stub_slow_seconds_total"
EXECUTIONS = "kiln_stub_executions_total"
REQUESTS = "kiln_stub_requests_total"
SLOW = "kiln_stub_slow_executions_total"
STAMPED = "kiln_stub_stamped_requests_total"
WAITED = "kiln_stub_waited_seconds_total"
LATE = "kiln_stub_late_requests_total"
SENT_PARAMETER = "kiln_sent_ns"
STAMPS_ENV = "KILN_STUB_STAMPS"  # a folder: StubStamps writes each stamped request's execution times there


class StubTimes:
    """The stub side: ``add`` after each execution; published every ``every_s`` seconds (at an execution)."""

    def __init__(self, model: str, pb_utils: Any, every_s: float | None = None) -> None:
        counter = pb_utils.MetricFamily.COUNTER
        seconds = pb_utils.MetricFamily(name=SECONDS, description="Kiln stub: seconds per phase", kind=counter)
        executions = pb_utils.MetricFamily(name=EXECUTIONS, description="Kiln stub: executions", kind=counter)
        requests = pb_utils.MetricFamily(name=REQUESTS, description="Kiln stub: requests executed", kind=counter)
        slow = pb_utils.MetricFamily(name=SLOW, description=f"Kiln stub: executions over {SLOW_S}s", kind=counter)
        slow_seconds = pb_utils.MetricFamily(
            name=SLOW_SECONDS, description="Kiln stub: seconds per phase of the slow executions", kind=counter
        )
        stamped = pb_utils.MetricFamily(name=STAMPED, description="Kiln stub: requests with a send time", kind=counter)
        waited = pb_utils.MetricFamily(name=WAITED, description="Kiln stub: seconds sent to executed", kind=counter)
        late = pb_utils.MetricFamily(name=LATE, description=f"Kiln stub: requests waiting over {SLOW_S}s", kind=counter)
        # the families must outlive their metrics (the stub refuses to update a metric whose family was deleted)
        self.families = (seconds, executions, requests, slow, slow_seconds, stamped, waited, late)
        self.metrics = {p: seconds.Metric(labels={"model": model, "phase": p}) for p in PHASES}
        for p in PHASES:
            self.metrics[f"{p}_slow"] = slow_seconds.Metric(labels={"model": model, "phase": p})
        self.metrics["executions"] = executions.Metric(labels={"model": model})
        self.metrics["requests"] = requests.Metric(labels={"model": model})
        self.metrics["slow_executions"] = slow.Metric(labels={"model": model})
        self.metrics["stamped_requests"] = stamped.Metric(labels={"model": model})
        self.metrics["waited_seconds"] = waited.Metric(labels={"model": model})
        self.metrics["late_requests"] = late.Metric(labels={"model": model})
        self.pending = dict.fromkeys(self.metrics, 0.0)
        self.every_s = float(os.environ.get("KILN_STUB_METRICS_S", "1")) if every_s is None else every_s
        self.published = time.monotonic()

    def add(
        self, requests: int, inputs: float, engine: float, responses: float, waits: list[float] | None = None
    ) -> None:
        """One execution of ``requests`` requests and its phases' seconds; ``waits``: the seconds from send to this
        execution's start of those of its requests that carried a send time (:func:`sent_times`)."""
        for key, value in zip(("inputs", "engine", "responses", "requests"), (inputs, engine, responses, requests)):
            self.pending[key] += value
        self.pending["executions"] += 1
        if waits:
            self.pending["stamped_requests"] += len(waits)
            self.pending["waited_seconds"] += sum(waits)
            self.pending["late_requests"] += sum(w > SLOW_S for w in waits)
        if inputs + engine + responses > SLOW_S:
            self.pending["slow_executions"] += 1
            for key, value in zip(SLOW_PHASES, (inputs, engine, responses)):
                self.pending[key] += value
        if time.monotonic() - self.published >= self.every_s:
            self.publish()

    def publish(self) -> None:
        """Every sum since the last publication, as increments of Triton's counters."""
        for key, metric in self.metrics.items():
            metric.increment(self.pending[key])
        self.pending = dict.fromkeys(self.metrics, 0.0)
        self.published = time.monotonic()

    def close(self) -> None:
        """The metrics, then their families (the order the stub wants them deleted in)."""
        self.metrics.clear()
        self.families = ()


def sent_times(requests: list[Any]) -> list[int]:
    """Each request's send time (its :data:`SENT_PARAMETER`, ns of the host's monotonic clock), for the requests
    that carry one."""
    out = []
    for request in requests:
        text = request.parameters()  # the request's parameters as JSON
        if SENT_PARAMETER in text:
            sent = json.loads(text).get(SENT_PARAMETER)
            if isinstance(sent, int):
                out.append(sent)
    return out


class StubStamps:
    """Per request, when the stub began and finished the execution that answered it, beside its send time: kept
    in memory and written to ``folder/stub-<pid>-<part>.npy`` (rows: sent, started, finished, in ns) every
    ``PART_ROWS`` rows and when the model is unloaded (a stub that Triton's shutdown kills loses only its last
    part), where :func:`join_stamps` meets them with the client's own record of each request. Only where the
    environment names the folder (:data:`STAMPS_ENV`): a diagnosis, not a server's everyday work; writing a part
    (about 100 KB) delays the execution that fills it."""

    PART_ROWS = 4096

    def __init__(self, folder: Path) -> None:
        self.folder, self.rows, self.parts = folder, [], 0

    @classmethod
    def from_env(cls) -> StubStamps | None:
        folder = os.environ.get(STAMPS_ENV)
        return cls(Path(folder)) if folder else None

    def add(self, sent: list[int], started: int, finished: int) -> None:
        self.rows.extend((s, started, finished) for s in sent)
        if len(self.rows) >= self.PART_ROWS:
            self.write()

    def write(self) -> None:
        """The rows kept so far, as the next part; nothing when none are kept."""
        import numpy as np

        if not self.rows:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        rows = np.asarray(self.rows, dtype=np.int64).reshape(-1, 3)
        np.save(self.folder / f"stub-{os.getpid()}-{self.parts}.npy", rows)
        self.rows, self.parts = [], self.parts + 1


_SAMPLE = re.compile(r"^(kiln_stub_\w+)\{([^}]*)\}\s+(\S+)", re.MULTILINE)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def read(metrics_url: str, model: str) -> dict[str, float] | None:
    """``model``'s stub counters from Triton's metrics endpoint (Prometheus' text format: the ``kiln_stub_*``
    names, a regular expression reads them), summed over its instances; None where the endpoint does not answer or has
    none (another server, a model that is not Kiln's Python-backend model)."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=5) as response:
            text = response.read().decode(errors="replace")
    except (OSError, ValueError):
        return None
    totals: dict[str, float] = {}
    for name, labels, value in _SAMPLE.findall(text):
        tags = dict(_LABEL.findall(labels))
        if tags.get("model") != model:
            continue
        if name == SECONDS:
            key = tags["phase"]
        elif name == SLOW_SECONDS:
            key = f"{tags['phase']}_slow"
        else:
            key = name.removeprefix("kiln_stub_").removesuffix("_total")
        totals[key] = totals.get(key, 0.0) + float(value)
    return totals if "executions" in totals else None


def split(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float] | None:
    """Mean ms per execution of each phase between two reads, and the executions and requests they cover; with
    ``slow_executions`` (how many took over :data:`SLOW_S`) and, where there were any, ``slow_ms``: each phase's
    mean ms over those. None without both reads or without an execution published between them."""
    if before is None or after is None:
        return None
    runs = after["executions"] - before.get("executions", 0.0)
    if runs <= 0:
        return None
    ms = {p: (after.get(p, 0.0) - before.get(p, 0.0)) / runs * 1e3 for p in PHASES}
    out = ms | {"executions": runs, "requests": after["requests"] - before.get("requests", 0.0)}
    stamped = after.get("stamped_requests", 0.0) - before.get("stamped_requests", 0.0)
    if stamped > 0:  # requests that carried their send time
        out["stamped_requests"] = stamped
        out["waited_ms"] = (after["waited_seconds"] - before.get("waited_seconds", 0.0)) / stamped * 1e3
        out["late_requests"] = after.get("late_requests", 0.0) - before.get("late_requests", 0.0)
    if "slow_executions" in after:  # a stub that counts them (Kiln's since slow executions were counted)
        slow = after["slow_executions"] - before.get("slow_executions", 0.0)
        out["slow_executions"] = slow
        if slow > 0:
            out["slow_ms"] = {
                p: (after.get(f"{p}_slow", 0.0) - before.get(f"{p}_slow", 0.0)) / slow * 1e3 for p in PHASES
            }
    return out


LEGS = ("to the stub", "in the stub", "back")


def joined(client: Any, stub: Any) -> Any:
    """The client's record (rows: sent, latency, in ns) met with the stubs' (:class:`StubStamps` rows: sent,
    started, finished) on the send time: one row per request met (sent, latency, started, finished, in ns),
    the unmet left out."""
    import numpy as np

    client, stub = np.asarray(client, dtype=np.int64).reshape(-1, 2), np.asarray(stub, dtype=np.int64).reshape(-1, 3)
    if not len(stub):
        return np.zeros((0, 4), dtype=np.int64)
    stub = stub[np.argsort(stub[:, 0])]
    at = np.minimum(np.searchsorted(stub[:, 0], client[:, 0]), len(stub) - 1)
    met = stub[at, 0] == client[:, 0]
    return np.concatenate([client[met], stub[at[met], 1:]], axis=1)


def join_stamps(client: Any, stub: Any, slowest: float = 0.01) -> dict[str, Any] | None:
    """Each request's three legs, from the client's record and the stubs' met by :func:`joined`: to the stub (sent
    to the execution's start: the HTTP frontend, Triton's queue and input copy, the hop), in the stub (its
    execution) and back (the execution's end to the answer in the client: the hop back, Triton's answer, the
    client). Per leg, p50 / p99 ms over the requests met and the mean ms over the ``slowest`` share of them by
    latency; None where none met."""
    import numpy as np

    return summary(joined(client, stub), len(np.asarray(client).reshape(-1, 2)), slowest)


def summary(rows: Any, requests: int, slowest: float = 0.01) -> dict[str, Any] | None:
    """:func:`join_stamps`' figures from rows :func:`joined` already made, of ``requests`` client requests."""
    import numpy as np

    if not len(rows):
        return None
    sent, latency, started, finished = np.asarray(rows, dtype=np.int64).reshape(-1, 4).T
    legs = np.stack([started - sent, finished - started, sent + latency - finished], axis=1) / 1e6
    slow = latency >= np.quantile(latency, 1 - slowest)
    found: dict[str, Any] = {"requests": int(requests), "met": int(len(sent)), "slowest": int(slow.sum())}
    for k, name in enumerate(LEGS):
        p50, p99 = np.percentile(legs[:, k], [50, 99])
        found[name] = {"p50": float(p50), "p99": float(p99), "slowest_mean": float(legs[slow, k].mean())}
    found["latency"] = {
        "p50": float(np.percentile(latency, 50) / 1e6),
        "slowest_mean": float(latency[slow].mean() / 1e6),
    }
    return found


def by_batch(rows: Any, edges: tuple[int, ...] = (8, 16)) -> list[dict[str, Any]]:
    """The requests of :func:`joined` rows grouped by the size of the execution that answered them (the requests
    met that share its start and end; batches up to each of ``edges``, then the rest; each group named up to the
    largest size seen in it): per group the share of the requests, the executions and their latency's p50 / p99 ms.
    Shows whether a tail comes from large batches."""
    import numpy as np

    rows = np.asarray(rows, dtype=np.int64).reshape(-1, 4)
    if not len(rows):
        return []
    _, which, sizes = np.unique(rows[:, 2:], axis=0, return_inverse=True, return_counts=True)
    batch, latency = sizes[which.ravel()], rows[:, 1] / 1e6
    groups, low = [], 1
    for high in (*edges, int(batch.max())):
        if high < low:
            break
        picked = (batch >= low) & (batch <= high)
        if picked.any():
            p50, p99 = np.percentile(latency[picked], [50, 99])
            top = int(batch[picked].max())  # the largest batch seen in the group, not the group's edge
            groups.append(
                {
                    "batches": f"{low}-{top}" if top > low else str(low),
                    "requests_share": float(picked.mean()),
                    "executions": int(((sizes >= low) & (sizes <= high)).sum()),
                    "p50_ms": float(p50),
                    "p99_ms": float(p99),
                }
            )
        low = high + 1
    return groups
