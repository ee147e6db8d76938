"""The stub's phase timings: published at most every interval as counters, read back from Prometheus' text format
and turned into ms per execution. The stub and Triton's endpoint themselves are exercised by the served test
(tests/serve/test_server.py), against a real `kiln serve`."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kiln.serve import stub_times

METRICS = """# HELP kiln_stub_seconds_total Kiln stub: seconds per phase
# TYPE kiln_stub_seconds_total counter
kiln_stub_seconds_total{model="m",phase="inputs"} 0.5
kiln_stub_seconds_total{model="m",phase="engine"} 2
kiln_stub_seconds_total{model="m",phase="responses"} 0.25
kiln_stub_seconds_total{model="m",phase="engine"} 2
kiln_stub_seconds_total{model="other",phase="engine"} 99
kiln_stub_executions_total{model="m"} 100
kiln_stub_executions_total{model="m"} 100
kiln_stub_requests_total{model="m"} 400
kiln_stub_slow_executions_total{model="m"} 2
kiln_stub_slow_seconds_total{model="m",phase="engine"} 0.05
nv_inference_count{model="m",version="1"} 400
"""


@pytest.fixture
def endpoint() -> Iterator[str]:
    """A real HTTP server answering METRICS, as Triton's metrics port does."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = METRICS.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    server.shutdown()


def test_a_models_counters_are_summed_over_its_instances_and_others_ignored(endpoint: str) -> None:
    got = stub_times.read(endpoint, "m")
    assert got == {
        "inputs": 0.5,
        "engine": 4.0,
        "responses": 0.25,
        "executions": 200.0,
        "requests": 400.0,
        "slow_executions": 2.0,
        "engine_slow": 0.05,
    }
    assert stub_times.read(endpoint, "absent") is None  # a model that publishes nothing


def test_an_endpoint_that_does_not_answer_gives_none() -> None:
    assert stub_times.read("http://127.0.0.1:1/metrics", "m") is None


def test_split_gives_ms_per_execution_between_two_reads() -> None:
    before = {"inputs": 1.0, "engine": 2.0, "responses": 0.5, "executions": 10.0, "requests": 30.0}
    after = {"inputs": 1.1, "engine": 2.5, "responses": 0.6, "executions": 110.0, "requests": 430.0}
    got = stub_times.split(before, after)
    assert got == pytest.approx({"inputs": 1.0, "engine": 5.0, "responses": 1.0, "executions": 100, "requests": 400})
    assert stub_times.split(before, before) is None  # nothing published in between
    assert stub_times.split(None, after) is None


class _Family:
    COUNTER = "counter"

    def __init__(self, name: str, description: str, kind: str) -> None:
        self.name, self.values = name, {}

    def Metric(self, labels: dict[str, str]) -> _Metric:  # noqa: N802 (pb_utils' own name)
        return _Metric(self, tuple(sorted(labels.items())))


class _Metric:
    def __init__(self, family: _Family, key: tuple) -> None:
        self.family, self.key = family, key

    def increment(self, value: float) -> None:
        self.family.values[self.key] = self.family.values.get(self.key, 0.0) + value


class _PbUtils:
    """The two names of triton_python_backend_utils that StubTimes uses (the module exists only inside a stub)."""

    MetricFamily = _Family


def test_timings_are_published_at_most_every_interval_and_all_of_them_in_the_end() -> None:
    times = stub_times.StubTimes("m", _PbUtils, every_s=3600)
    seconds = times.families[0]
    times.add(4, 0.001, 0.002, 0.0005)
    times.add(2, 0.001, 0.002, 0.0005)
    assert seconds.values == {}  # within the interval: nothing sent to Triton yet
    times.publish()
    assert seconds.values[(("model", "m"), ("phase", "engine"))] == pytest.approx(0.004)
    assert times.families[2].values[(("model", "m"),)] == 6  # requests
    every = stub_times.StubTimes("m", _PbUtils, every_s=0)
    every.add(1, 0.001, 0.002, 0.0005)
    assert every.families[1].values[(("model", "m"),)] == 1  # an interval of 0: each execution at once


def test_executions_over_the_slow_mark_are_counted_with_their_phases() -> None:
    times = stub_times.StubTimes("m", _PbUtils, every_s=3600)
    times.add(4, 0.001, 0.002, 0.0005)  # 3.5 ms: not slow
    times.add(4, 0.001, 0.020, 0.0005)  # 21.5 ms: slow, in the engine
    times.publish()
    seconds, slow, slow_seconds = (times.families[k].values for k in (0, 3, 4))
    assert slow == {(("model", "m"),): 1}
    assert slow_seconds[(("model", "m"), ("phase", "engine"))] == pytest.approx(0.020)
    assert seconds[(("model", "m"), ("phase", "engine"))] == pytest.approx(0.022)  # all executions, slow included


def test_split_gives_the_slow_executions_phases_where_there_were_any() -> None:
    before = {"engine": 1.0, "executions": 10.0, "requests": 30.0, "slow_executions": 1.0, "engine_slow": 0.02}
    after = {"engine": 1.5, "executions": 110.0, "requests": 430.0, "slow_executions": 3.0, "engine_slow": 0.06}
    got = stub_times.split(before, after)
    assert got["slow_executions"] == 2 and got["slow_ms"] == pytest.approx({"inputs": 0, "engine": 20, "responses": 0})
    assert "slow_ms" not in stub_times.split(before, {**after, "slow_executions": 1.0})  # none this time
    assert "slow_executions" not in stub_times.split({"executions": 0.0}, {"executions": 5.0, "requests": 5.0})


class _Request:
    def __init__(self, parameters: str) -> None:
        self.text = parameters

    def parameters(self) -> str:  # pb_utils.InferenceRequest's: the request's parameters as JSON
        return self.text


def test_requests_that_carry_their_send_time_are_timed_to_the_execution_and_the_late_ones_counted() -> None:
    start = 10_000_000_000
    requests = [
        _Request(json.dumps({"kiln_sent_ns": start - 2_000_000})),  # sent 2 ms before the execution began
        _Request(json.dumps({"kiln_sent_ns": start - 30_000_000})),  # 30 ms: late
        _Request("{}"),  # no send time: left out
    ]
    sent = stub_times.sent_times(requests)
    assert sent == [start - 2_000_000, start - 30_000_000]
    waited = [(start - t) / 1e9 for t in sent]  # as the stub's model times them
    times = stub_times.StubTimes("m", _PbUtils, every_s=3600)
    times.add(3, 0.001, 0.002, 0.0005, waited)
    times.publish()
    stamped, seconds, late = (times.families[k].values[(("model", "m"),)] for k in (5, 6, 7))
    assert stamped == 2 and seconds == pytest.approx(0.032) and late == 1
    before = {"executions": 0.0, "requests": 0.0}
    after = {"executions": 1.0, "requests": 3.0, "stamped_requests": 2.0, "waited_seconds": 0.032, "late_requests": 1.0}
    got = stub_times.split(before, after)
    assert got["stamped_requests"] == 2 and got["waited_ms"] == pytest.approx(16.0) and got["late_requests"] == 1


def test_stub_stamps_are_written_only_where_the_environment_asks_and_meet_the_clients_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(stub_times.STAMPS_ENV, raising=False)
    assert stub_times.StubStamps.from_env() is None  # a server's everyday work: nothing recorded
    monkeypatch.setenv(stub_times.STAMPS_ENV, str(tmp_path / "stamps"))
    stamps = stub_times.StubStamps.from_env()
    ms = 1_000_000
    stamps.add([100 * ms, 101 * ms], started=103 * ms, finished=105 * ms)  # one execution of two requests
    stamps.add([200 * ms], started=230 * ms, finished=232 * ms)  # a request that waited 30 ms for its execution
    stamps.write()
    (written,) = (tmp_path / "stamps").glob("stub-*.npy")
    client = [(100 * ms, 6 * ms), (101 * ms, 5 * ms), (200 * ms, 40 * ms), (300 * ms, 1 * ms)]  # the last: no record
    found = stub_times.join_stamps(client, np.load(written), slowest=0.34)
    assert found["requests"] == 4 and found["met"] == 3 and found["slowest"] == 1, found
    slow = {leg: found[leg]["slowest_mean"] for leg in stub_times.LEGS}
    assert slow == pytest.approx({"to the stub": 30.0, "in the stub": 2.0, "back": 8.0})  # 30 + 2 + 8 = its 40 ms
    assert stub_times.join_stamps(client, np.zeros((0, 3))) is None


def test_stub_stamps_are_written_in_parts_so_a_killed_stub_loses_only_its_last(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stub_times.StubStamps, "PART_ROWS", 3)
    stamps = stub_times.StubStamps(tmp_path / "stamps")
    for k in range(4):  # two requests an execution: a part after the second and the fourth
        stamps.add([10 * k, 10 * k + 1], started=10 * k + 5, finished=10 * k + 7)
    parts = sorted((tmp_path / "stamps").glob("stub-*.npy"))
    assert [len(np.load(p)) for p in parts] == [4, 4]  # written as the stub runs, before any unload
    stamps.write()
    stamps.write()  # nothing kept: no empty part
    rows = np.concatenate([np.load(p) for p in sorted((tmp_path / "stamps").glob("stub-*.npy"))])
    assert len(rows) == 8 and sorted(rows[:, 0]) == [0, 1, 10, 11, 20, 21, 30, 31]


def test_requests_grouped_by_their_executions_batch_show_where_a_tail_comes_from() -> None:
    ms = 1_000_000
    small = [(k * ms, 4 * ms, 100 * ms + k, 101 * ms + k) for k in range(4)]  # four executions of one request
    large = [(k * ms, 30 * ms, 200 * ms, 210 * ms) for k in range(10, 20)]  # one of ten: the slow ones
    groups = stub_times.by_batch(np.array(small + large), edges=(8,))
    assert [g["batches"] for g in groups] == ["1", "9-10"]  # up to the largest size seen
    assert [g["executions"] for g in groups] == [4, 1]
    assert groups[0]["requests_share"] == pytest.approx(4 / 14) and groups[1]["p99_ms"] == pytest.approx(30.0)
    assert stub_times.by_batch(np.zeros((0, 4))) == []
