"""`kiln serve` and `kiln loadtest` against a real Triton server (PyTriton's bundled tritonserver), on the FP32
ONNX Runtime engine of a tiny pipeline run. Ports are ephemeral; readiness is polled with a timeout."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
from click.testing import CliRunner

from kiln.cli import main
from kiln.core.errors import BackendUnavailable, ConfigError, GateFailure, KilnError
from kiln.core.inputs import random_inputs
from kiln.pipeline.api import run_pipeline
from kiln.pipeline.config import KilnConfig, config_from_dict
from kiln.serve.batching import pad_rows
from kiln.serve.loadtest import CLIENT_SWITCH_S, loadtest, parse_url
from kiln.serve.server import (
    CPU_MAX_BATCH,
    GPU_STUB_MAX_BATCH,
    PortInUse,
    check_stub_numpy,
    drain_models,
    find_engines,
    free_port,
    free_ports,
    serve,
    stub_python_env,
    tritonserver_process,
    wait_ready,
)
from kiln.serve.stub_parent import REGION_PREFIX
from kiln.stages.engines.backend import read_metadata
from kiln.stages.engines.registry import load_engine
from tests.conftest import tiny_config_dict

pytestmark = pytest.mark.slow  # a Triton server per test, in its own process

ENGINE = "onnxruntime-cpu-fp32"
MODEL = "onnxruntime_cpu_fp32"
# Hang guards, not speed tests: each wait returns as soon as the server is ready or gone, and the limits are far
# above what a heavily loaded machine needs (startup ~3 s idle, stopping ~15 s), so no pass depends on the load.
READY_TIMEOUT_S = 600
STOP_TIMEOUT_S = 600
GONE_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def config() -> KilnConfig:
    return config_from_dict(tiny_config_dict())


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory, config: KilnConfig) -> Path:
    out = tmp_path_factory.mktemp("serve") / "run"
    result, _ = run_pipeline(config, out)
    assert result.ok
    return out


def _start_serve(
    path: Path, ports: list[int], *extra: str, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        "-m",
        "kiln.cli",
        "serve",
        str(path),
        "--http-port",
        str(ports[0]),
        "--grpc-port",
        str(ports[1]),
        "--metrics-port",
        str(ports[2]),
        *extra,
    ]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})


def _ready(proc: subprocess.Popen[bytes], ports: list[int], models: list[str]) -> None:
    """wait_ready, and when the server exits before it is ready, the failure shows what `kiln serve` printed."""
    try:
        wait_ready(f"http://127.0.0.1:{ports[0]}", models, READY_TIMEOUT_S, proc, tuple(ports[1:]))
    except KilnError as exc:
        if proc.poll() is None:
            raise
        raise AssertionError(f"{exc.message}; kiln serve printed:\n{_printed(proc)}") from None


def _max_batch(ports: list[int], model: str) -> int:
    """The largest batch the running server's dynamic batcher forms for ``model`` (Triton's model config)."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{ports[0]}/v2/models/{model}/config", timeout=30) as answer:
        return int(json.load(answer)["max_batch_size"])


def _printed(proc: subprocess.Popen[bytes]) -> str:
    """What an ended (or killed) ``kiln serve`` printed, its last 3000 characters."""
    try:  # communicate, not read: a server child still holding the pipe must not hang the test
        printed = (proc.communicate(timeout=30)[0] or b"").decode(errors="replace")
    except subprocess.TimeoutExpired:
        printed = "(no output: the pipe stayed open)"
    return printed[-3000:]


def _abort(proc: subprocess.Popen[bytes]) -> None:
    """A failing test still stops the server cleanly (SIGKILL would leave PyTriton's workspace behind)."""
    proc.terminate()
    try:
        proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()


def _stop_and_check(proc: subprocess.Popen[bytes], descendants: list[psutil.Process], sig: int) -> str:
    """Stop ``kiln serve`` with ``sig``; nothing of it is left running. Returns what it printed."""
    proc.send_signal(sig)
    try:
        out, _ = proc.communicate(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        for p in [*descendants, psutil.Process(proc.pid)]:  # nothing left running after a failed test
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        raise AssertionError(
            f"kiln serve did not stop within {STOP_TIMEOUT_S} s of signal {sig}; it printed:\n{_printed(proc)}"
        ) from None
    printed = (out or b"").decode()  # None: its output went to files
    assert proc.returncode == 0, printed[-3000:]
    _, alive = psutil.wait_procs(descendants, timeout=GONE_TIMEOUT_S)
    assert not alive, f"left behind: {[p.pid for p in alive]}"
    return printed


@pytest.fixture(scope="module")
def loaded(workdir: Path) -> Iterator[list[int]]:
    """`kiln serve` on the run's workdir, the server the load tests below share (its ports). A 2 ms batching
    window: concurrent requests reliably meet in one batch even on a loaded machine. After them it is stopped with
    SIGTERM, and nothing of it may be left running (a failure there is the last of them's teardown error)."""
    ports = free_ports(3)
    # every execution publishes its phases at once (kiln.serve.stub_times), so a short level has them
    proc = _start_serve(workdir, ports, "--max-queue-delay-us", "2000", env={"KILN_STUB_METRICS_S": "0"})
    try:
        _ready(proc, ports, [MODEL])
        descendants = psutil.Process(proc.pid).children(recursive=True)
        assert any("tritonserver" in p.name() for p in descendants)
    except BaseException:
        _abort(proc)
        raise
    yield ports
    _stop_and_check(proc, descendants, signal.SIGTERM)


def test_served_answers_match_the_engine_under_load_and_batches_form(
    loaded: list[int], workdir: Path, config: KilnConfig, tmp_path: Path
) -> None:
    ports = loaded
    result = loadtest(
        f"http://127.0.0.1:{ports[0]}",
        MODEL,
        workdir,
        tmp_path / "lt",
        [8],
        duration_s=120,
        max_requests=200,
        config=config,
        metrics_port=ports[2],
    )
    cli = CliRunner().invoke(
        main,
        [
            "loadtest",
            f"grpc://127.0.0.1:{ports[1]}",
            "--model",
            MODEL,
            "-e",
            str(workdir),
            "--concurrency",
            "1,2",
            "--duration",
            "1",
            "--requests",
            "20",
            "--metrics-port",
            str(ports[2]),
            "-o",
            str(tmp_path / "cli"),
        ],
    )
    assert cli.exit_code == 0, cli.output
    assert "| 2 | 20 |" in cli.output and (tmp_path / "cli" / "loadtest.png").is_file()
    level = result["levels"][0]
    assert level["requests"] == 200 and level["mismatches"] == 0 and level["errors"] == 0, level
    assert result["inputs"].startswith("real validation data")
    assert level["client_switch_interval_s"] == pytest.approx(CLIENT_SWITCH_S)  # the clients' own, not Python's
    assert result["server"]["inference_count"] == 200  # Triton's own statistics, over this load test's requests
    assert result["server"]["execution_count"] < 200  # batches of several requests ran
    split = level["server_split_ms"]  # where the requests' time went, from Triton's statistics and the client's
    assert split["compute_infer"] > 0 and split["mean_batch"] == 200 / result["server"]["execution_count"], split
    assert sum(split[k] for k in split if k != "mean_batch") == pytest.approx(level["latency_ms"]["mean"], rel=0.05)
    formed = level["inprocess_formed"]  # the engine in-process at the batch the server formed, beside it
    assert formed["batch"] == max(1, round(split["mean_batch"])) and formed["throughput_rps"] > 0
    assert level["served_vs_formed"] == pytest.approx(level["throughput_rps"] / formed["throughput_rps"])
    split_md = (tmp_path / "lt" / "loadtest.md").read_text().split("Where a request's time went")[1]
    assert f"| {formed['throughput_rps']:.0f} ({formed['batch']}) | {level['served_vs_formed']:.2f} |" in split_md
    stub = level["stub_ms"]  # inside the executions, on the stub's clock: every phase took time, the engine most
    assert stub["executions"] > 0 and stub["requests"] >= stub["executions"], stub
    assert all(stub[p] > 0 for p in ("inputs", "engine", "responses")), stub
    assert stub["inputs"] + stub["engine"] + stub["responses"] < 1.5 * stub["execution"], stub  # Triton's whole
    assert "| concurrency | execution | inputs | engine | responses | rest | over 10 ms: executions" in split_md
    assert stub["slow_executions"] == 0 or set(stub["slow_ms"]) == {"inputs", "engine", "responses"}, stub
    assert f"| {stub['rest']:.3f} | {stub['slow_executions']:.0f}" in split_md, split_md
    cpu = level["cpu_cores"]  # the CPU the level used: Triton and its stubs worked, so did this process's clients
    assert cpu["server"] > 0 and cpu["clients"] > 0 and 0 < cpu["busy"] <= cpu["cores"], cpu
    assert f"{cpu['busy']:.1f} / {cpu['server']:.1f} / {cpu['clients']:.1f} of {cpu['cores']} |" in split_md
    for name in ("loadtest.json", "loadtest.md", "loadtest.png"):
        assert (tmp_path / "lt" / name).stat().st_size > 0
    assert json.loads((tmp_path / "lt" / "loadtest.json").read_text())["levels"][0]["requests"] == 200


def test_stamped_requests_are_timed_by_the_stub_and_their_legs_meet_its_record(
    workdir: Path, config: KilnConfig, tmp_path: Path
) -> None:
    """With KILN_STUB_STAMPS the stubs time each request that carries its send time to its execution (published
    with their phases, every execution at once here) and record its execution, met with the client's record. The
    server runs with two HTTP threads (--http-threads reaches tritonserver)."""
    import numpy as np

    from kiln.serve.stub_times import LEGS, STAMPS_ENV, join_stamps

    ports = free_ports(3)
    engine = workdir / "package" / "engines" / ENGINE
    env = {STAMPS_ENV: str(tmp_path / "stamps"), "KILN_STUB_METRICS_S": "0"}
    proc = _start_serve(engine, ports, "--http-threads", "2", env=env)
    try:
        _ready(proc, ports, [MODEL])
        descendants = psutil.Process(proc.pid).children(recursive=True)
        triton = [p.cmdline() for p in descendants if p.name() == "tritonserver"]
        assert len(triton) == 1 and "--http-thread-count=2" in triton[0], triton
        built = read_metadata(engine).max_batch()  # a CPU engine: the CPU's default batch, capped by the engine
        assert _max_batch(ports, MODEL) == min(CPU_MAX_BATCH, built or CPU_MAX_BATCH)
        result = loadtest(
            f"http://127.0.0.1:{ports[0]}",
            MODEL,
            engine,
            tmp_path / "lt",
            [4],
            120,
            80,
            config,
            shared_memory=True,
            metrics_port=ports[2],
            stamped=True,
        )
        level = result["levels"][0]
        assert level["requests"] == 80 and level["mismatches"] == 0 and level["errors"] == 0, level
        stub = level["stub_ms"]  # each stub execution timed its requests from their send time (kiln.serve.stub_times)
        assert stub["stamped_requests"] > 0 and stub["late_requests"] <= stub["stamped_requests"], stub
        assert 0 < stub["waited_ms"] < level["latency_ms"]["mean"], (stub, level["latency_ms"])  # a part of it
        assert "sent to executed: mean ms" in (tmp_path / "lt" / "loadtest.md").read_text()
    except BaseException:
        _abort(proc)
        raise
    _stop_and_check(proc, descendants, signal.SIGTERM)  # the stubs write their records as they unload
    client = np.load(tmp_path / "lt" / "stamps-c4.npy")
    stub = np.concatenate([np.load(f) for f in (tmp_path / "stamps").glob("stub-*.npy")])
    found = join_stamps(client, stub)
    assert client.shape == (80, 2) and found["met"] == 80, found  # every request's execution was recorded
    # one clock on both sides: every leg took time, none ran backwards
    assert all(found[leg]["p50"] > 0 for leg in LEGS), found


def test_tensors_through_shared_memory_give_the_same_checked_answers_and_leave_nothing(
    loaded: list[int], workdir: Path, config: KilnConfig, tmp_path: Path
) -> None:
    import tritonclient.http

    switch = sys.getswitchinterval()
    for url, processes in ((f"http://127.0.0.1:{loaded[0]}", 2), (f"grpc://127.0.0.1:{loaded[1]}", 1)):
        result = loadtest(
            url,
            MODEL,
            workdir,
            tmp_path / url[:4],
            [1, 4],
            120,
            40,
            config,
            processes,
            shared_memory=True,
            switch_interval_s=3e-4,
        )  # c = 4 in client processes (http), c = 1 in this one: each ran at the switch interval asked for
        for level in result["levels"]:
            assert level["requests"] == 40 and level["mismatches"] == 0 and level["errors"] == 0, level
            assert level["client_switch_interval_s"] == pytest.approx(3e-4), level
        assert sys.getswitchinterval() == switch  # this process's own, back as it was
        assert result["transport"] == "system shared memory"
        assert "tensors in system shared memory" in (tmp_path / url[:4] / "loadtest.md").read_text()
        # over HTTP Kiln's own client sends them (kiln.serve.http_client); tritonclient over gRPC
        assert result["client"] == ("kiln" if url.startswith("http") else "tritonclient"), result["client"]
    url = f"http://127.0.0.1:{loaded[0]}"  # tritonclient over HTTP when asked: the same checked answers
    result = loadtest(
        url, MODEL, workdir, tmp_path / "tc", [2], 60, 20, config, shared_memory=True, client="tritonclient"
    )
    assert result["client"] == "tritonclient" and result["levels"][0]["mismatches"] == 0, result["levels"]
    assert result["levels"][0]["requests"] == 20 and result["levels"][0]["errors"] == 0, result["levels"]
    with pytest.raises(ConfigError, match="HTTP requests whose tensors are in shared memory only"):
        loadtest(f"grpc://127.0.0.1:{loaded[1]}", MODEL, workdir, tmp_path / "g", [1], 1, client="kiln")
    client = tritonclient.http.InferenceServerClient(f"127.0.0.1:{loaded[0]}")
    assert client.get_system_shared_memory_status() == []  # every region unregistered
    assert not list(Path("/dev/shm").glob("kiln_*"))  # and removed
    with pytest.raises(ConfigError, match="shared-memory needs a Triton server"):
        loadtest("ray://127.0.0.1:1", MODEL, workdir, tmp_path / "ray", [1], 1, shared_memory=True)


def test_pytriton_serves_the_same_answers_and_takes_no_gpus(workdir: Path, config: KilnConfig, tmp_path: Path) -> None:
    """`kiln serve --pytriton`: the engine in the server's own process, bound through PyTriton (the path the default
    Python-backend stubs are measured against); --gpus belongs to the default path only."""
    ports = free_ports(3)
    proc = _start_serve(workdir, ports, "--pytriton")
    try:
        _ready(proc, ports, [MODEL])
        descendants = psutil.Process(proc.pid).children(recursive=True)
        result = loadtest(f"grpc://127.0.0.1:{ports[1]}", MODEL, workdir, tmp_path / "lt", [4], 60, 40, config=config)
    except BaseException:
        _abort(proc)
        raise
    _stop_and_check(proc, descendants, signal.SIGTERM)
    level = result["levels"][0]
    assert level["requests"] == 40 and level["mismatches"] == 0 and level["errors"] == 0, level
    with pytest.raises(ConfigError, match="not PyTriton"):
        serve(workdir, gpus=[0], pytriton=True)
    cli = CliRunner().invoke(main, ["serve", str(workdir), "--pytriton", "--gpus", "0"])
    assert cli.exit_code != 0 and "error:" in cli.output and "fix:" in cli.output, cli.output


def test_a_dead_stub_is_said_and_its_model_reloaded(workdir: Path) -> None:
    """A model instance's stub process killed (out of memory, a crash in the engine): requests sent to it get
    Triton's error naming the stub, `kiln serve` logs which instance died and reloads the model, and the same
    request is answered correctly again; then SIGTERM still leaves nothing running (issue 34: a dead replica)."""
    import tritonclient.http as httpclient

    engine = workdir / "package" / "engines" / ENGINE
    ports = free_ports(3)
    proc = _start_serve(engine, ports)
    feed = random_inputs(read_metadata(engine).inputs, 1, seed=5)
    with load_engine(engine) as runner:
        want = runner.infer(feed)["logits"]
    client = httpclient.InferenceServerClient(f"127.0.0.1:{ports[0]}", network_timeout=60)

    def ask() -> Any:
        tensor = httpclient.InferInput("input", list(feed["input"].shape), "FP32")
        tensor.set_data_from_numpy(feed["input"])
        try:
            return client.infer(MODEL, [tensor]).as_numpy("logits")
        except Exception as exc:  # tritonclient's InferenceServerException: the answer under test
            return exc

    try:
        _ready(proc, ports, [MODEL])
        stubs = [p for p in psutil.Process(proc.pid).children(recursive=True) if p.name().startswith("triton_python")]
        assert len(stubs) == 1, stubs
        np.testing.assert_allclose(ask(), want, rtol=1e-5, atol=1e-6)
        stubs[0].kill()
        answers, deadline = [], time.monotonic() + GONE_TIMEOUT_S
        while time.monotonic() < deadline and (not answers or isinstance(answers[-1], Exception)):
            answers.append(ask())
            time.sleep(0.1)
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except BaseException:
        _abort(proc)
        raise
    client.close()
    printed = _stop_and_check(proc, descendants, signal.SIGTERM)  # first: a failed check below leaves no server
    errors = [a for a in answers if isinstance(a, Exception)]
    assert all("not healthy" in str(e) for e in errors), errors[:3]
    assert not isinstance(answers[-1], Exception), f"still failing: {answers[-1]}; kiln serve:\n{printed[-3000:]}"
    np.testing.assert_allclose(answers[-1], want, rtol=1e-5, atol=1e-6)
    # named by its pid where kiln serve had seen it alive; a stub killed before its first look is found all the same
    said = " ".join(printed.split())
    named = f"died (stub process {stubs[0].pid}); reloading the model"
    assert named in said or "an instance's stub process is gone; reloading the model" in said, printed[-2000:]
    assert f"model {MODEL} reloaded" in printed, printed[-2000:]


def test_an_unreadable_answer_is_counted_not_lost(
    loaded: list[int], workdir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the numpy-2 stub produced: answers whose outputs cannot take their shape. Each is a counted error and
    a mismatch, not an exception that ends a client thread (the load test then reported 0 requests, 0 errors)."""
    import tritonclient.grpc as grpcclient

    def unreadable(self: Any, name: str) -> Any:
        raise ValueError("cannot reshape array of size 0 into shape (1,10)")

    monkeypatch.setattr(grpcclient.InferResult, "as_numpy", unreadable)
    with pytest.raises(GateFailure, match="10 answers differed"):
        loadtest(f"grpc://127.0.0.1:{loaded[1]}", MODEL, workdir, tmp_path / "lt", [2], duration_s=60, max_requests=10)
    level = json.loads((tmp_path / "lt" / "loadtest.json").read_text())["levels"][0]
    assert level["requests"] == 10 and level["mismatches"] == 10 and level["errors"] == 10, level
    assert "unreadable" in level["error_examples"][0]


def _pending(metrics_port: int) -> int:
    """Triton's count of requests queued or running (its Prometheus metric), over every model."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30) as response:
        text = response.read().decode()
    lines = [line for line in text.splitlines() if line.startswith("nv_inference_pending_request_count{")]
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in lines)


def test_sigterm_drains_requests_in_flight_and_everything_is_gone_within_10_s(workdir: Path) -> None:
    """Four requests held in Triton's batching window (1 s) when SIGTERM arrives, more load arriving: the four are
    answered correctly, and `kiln serve` with every process under it is gone within 10 s of the signal (issue 34:
    the demo's server took 16 s idle and left a process alive past 30 s under load)."""
    import threading

    import tritonclient.http as httpclient

    ports = free_ports(3)
    engine = workdir / "package" / "engines" / ENGINE
    proc = _start_serve(engine, ports, "--max-queue-delay-us", "1000000")
    feeds = [random_inputs(read_metadata(engine).inputs, 1, seed=i) for i in range(4)]
    answers: dict[int, Any] = {}

    def send(i: int) -> None:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{ports[0]}", network_timeout=60)
        tensor = httpclient.InferInput("input", [1, 1, 8, 8], "FP32")
        tensor.set_data_from_numpy(feeds[i]["input"])
        try:
            answers[i] = client.infer(MODEL, [tensor]).as_numpy("logits")
        except Exception as exc:
            answers[i] = exc

    try:
        _ready(proc, ports, [MODEL])
        descendants = psutil.Process(proc.pid).children(recursive=True)
        threads = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(4)]
        for t in threads:
            t.start()
        while _pending(ports[2]) < 4 and len(answers) < 4:  # all four inside the batching window
            time.sleep(0.02)
    except BaseException:
        _abort(proc)
        raise
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    everything = [psutil.Process(proc.pid), *descendants]
    _, alive = psutil.wait_procs(everything, timeout=10)
    gone_after = time.monotonic() - signalled
    for p in alive:  # nothing left running after a failed test
        p.kill()
    assert not alive, f"left {len(alive)} processes past 10 s: {[p.pid for p in alive]}"
    for t in threads:
        t.join(timeout=60)
    with load_engine(engine) as runner:
        for i, feed in enumerate(feeds):
            assert not isinstance(answers[i], Exception), f"request {i} in flight at SIGTERM failed: {answers[i]}"
            np.testing.assert_allclose(answers[i], runner.infer(feed)["logits"], rtol=1e-5, atol=1e-6)
    print(f"kiln serve and its {len(descendants)} processes gone {gone_after:.1f} s after SIGTERM")


def _keep_sending(port: int, body: str, until: threading.Event, records: list[tuple[float, int, str]]) -> None:
    """Inference requests one after another on one keep-alive connection until ``until``: (sent at, HTTP status or
    -1, the error's type or the answer's text)."""
    import http.client

    conn = None
    while not until.is_set():
        sent = time.monotonic()
        try:
            if conn is None:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            conn.request("POST", f"/v2/models/{MODEL}/infer", body, {"Content-Type": "application/json"})
            answer = conn.getresponse()
            text = answer.read().decode(errors="replace")
            records.append((sent, answer.status, "" if answer.status == 200 else text))
        except (OSError, http.client.HTTPException) as exc:
            records.append((sent, -1, type(exc).__name__))
            conn = None
            time.sleep(0.01)


@pytest.mark.parametrize("extra", [[], ["--pytriton"]], ids=["python-backend", "pytriton"])
def test_sigterm_under_steady_load_refuses_new_work_and_cuts_none_in_flight(workdir: Path, extra: list[str]) -> None:
    """Clients sending back to back when SIGTERM arrives: every request sent before the signal is answered (none
    cut by the server's exit), new requests are refused once the stop began (the models are unloaded: Triton
    answers 404), and `kiln serve` with every process under it is gone within 10 s of the signal."""
    ports = free_ports(3)
    engine = workdir / "package" / "engines" / ENGINE
    batch = random_inputs(read_metadata(engine).inputs, 4, seed=0)["input"]
    tensor = {"name": "input", "shape": list(batch.shape), "datatype": "FP32", "data": batch.ravel().tolist()}
    body = json.dumps({"inputs": [tensor]})
    proc = _start_serve(engine, ports, *extra, "--max-queue-delay-us", "2000")
    until, records = threading.Event(), []
    clients = [threading.Thread(target=_keep_sending, args=(ports[0], body, until, records)) for _ in range(3)]
    try:
        _ready(proc, ports, [MODEL])
        descendants = psutil.Process(proc.pid).children(recursive=True)
        for t in clients:
            t.start()
        while sum(1 for r in records if r[1] == 200) < 30:  # steady load: answers coming
            assert proc.poll() is None, _printed(proc)
            time.sleep(0.02)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        everything = [psutil.Process(proc.pid), *descendants]
        _, alive = psutil.wait_procs(everything, timeout=10)
    finally:
        until.set()
        for t in clients:
            t.join(timeout=120)
        _abort(proc)
    assert not alive, f"left {len(alive)} processes past 10 s: {[p.pid for p in alive]}"
    cut = [r for r in records if r[0] < signalled and r[1] != 200]
    assert not cut, f"requests sent before SIGTERM failed: {cut[:5]}"
    refused = [r for r in records if r[0] >= signalled and r[1] == 404 and "no available versions" in r[2]]
    assert refused, f"no request was refused after SIGTERM: {sorted({r[1:] for r in records if r[0] >= signalled})}"


def test_a_kiln_serve_killed_outright_takes_its_server_with_it_and_its_workdir_refuses_runs_meanwhile(
    workdir: Path, tmp_path: Path
) -> None:
    """SIGKILL of `kiln serve` left tritonserver (re-parented to PID 1) and its stubs serving from a scratch folder
    the next `kiln serve` removed, holding the ports. Now the server gets SIGTERM when `kiln serve` dies, Triton's
    stubs go with it, and a new `kiln serve` on the same ports starts. While served, the workdir refuses a run."""
    ports = free_ports(3)
    proc = _start_serve(workdir, ports)
    try:
        _ready(proc, ports, [MODEL])
        descendants = psutil.Process(proc.pid).children(recursive=True)
        names = {p.name() for p in descendants}
        assert "tritonserver" in names and any(n.startswith("triton_python") for n in names), names
        own = tmp_path / "tiny.yaml"  # the run's own config: without one, the demo's refusal would come first
        own.write_text(json.dumps(tiny_config_dict()))
        refused = CliRunner().invoke(main, ["run", str(own), "-w", str(workdir)])
    except BaseException:
        _abort(proc)
        raise
    proc.kill()
    proc.wait()
    _, alive = psutil.wait_procs(descendants, timeout=GONE_TIMEOUT_S)
    for p in alive:  # nothing left running after a failed test
        p.kill()
    assert not alive, f"left behind: {[(p.pid, p.name()) for p in alive]}"
    lines = [line for line in refused.output.splitlines() if line.strip()]
    assert refused.exit_code == 2 and len(lines) == 2, refused.output
    assert lines[0].startswith(f"error: workdir {workdir} is being served by kiln serve (pid "), refused.output
    assert lines[1] == "fix: stop the server first, or run into another workdir with -w", refused.output
    again = _start_serve(workdir, ports)  # the ports are free again
    try:
        _ready(again, ports, [MODEL])
        descendants = psutil.Process(again.pid).children(recursive=True)
    except BaseException:
        _abort(again)
        raise
    _stop_and_check(again, descendants, signal.SIGTERM)


def test_the_stubs_of_a_server_killed_outright_end_themselves_and_free_their_shared_memory(workdir: Path) -> None:
    """A tritonserver gone while its own parent does not reap it (a `kiln serve` killed outright under load: the
    server's exit leaves a zombie under an init that does not reap) left its stubs running under PID 1, each with its
    engine and its /dev/shm region, deaf to SIGTERM: Triton's stub checks its server with kill(pid, 0), which a
    zombie passes. Kiln's stub ends itself once re-parented. `kiln serve` stopped (SIGSTOP) makes the zombie here."""
    ports = free_ports(3)
    proc = _start_serve(workdir, ports)
    try:
        _ready(proc, ports, [MODEL])
        server = next(p for p in psutil.Process(proc.pid).children(recursive=True) if p.name() == "tritonserver")
        stubs = [p for p in server.children() if p.name().startswith("triton_python")]
        regions = [Path("/dev/shm") / a for s in stubs for a in s.cmdline() if a.startswith(REGION_PREFIX)]
        assert stubs and len(regions) == len(stubs), [s.cmdline() for s in stubs]
        assert all(r.exists() for r in regions)
        proc.send_signal(signal.SIGSTOP)  # kiln serve does not reap its server meanwhile
        try:
            server.kill()
            _, alive = psutil.wait_procs(stubs, timeout=GONE_TIMEOUT_S)
            for p in alive:  # nothing left running after a failed test
                p.kill()
        finally:
            proc.send_signal(signal.SIGCONT)
        assert not alive, f"left behind: {[(p.pid, p.name()) for p in alive]}"
        assert not [r for r in regions if r.exists()]
    finally:
        _abort(proc)


def test_a_server_that_dies_while_starting_is_one_error_in_seconds(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tritonserver fails to bind its gRPC port (taken after the check) and exits: PyTriton waited 120 s and
    raised its own traceback; now the wait ends when the process does, with Triton's reason."""
    import kiln.serve.server

    monkeypatch.setattr(kiln.serve.server, "check_ports", lambda *a: None)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(kiln.serve.server.ServerDied, match="exited while starting: .*already in use"):
            serve(workdir, http_port=free_port(), grpc_port=busy.getsockname()[1], metrics_port=free_port())


def test_serve_is_quiet_unless_verbose_and_sigint_stops_it_and_its_children(workdir: Path, tmp_path: Path) -> None:
    """The URLs on stdout and one line on stderr; Triton's own log (startup tables, NVML probes) only with -v. Then
    SIGINT (Ctrl-C) stops the server and every process under it. The workdir is given relative to the current folder,
    as a user types it (the server starts in its scratch folder, where a relative path once named nothing)."""
    ports = free_ports(3)
    out, err = tmp_path / "out", tmp_path / "err"
    cmd = [sys.executable, "-m", "kiln.cli", "serve", workdir.name, "--http-port", str(ports[0])]
    cmd += ["--grpc-port", str(ports[1]), "--metrics-port", str(ports[2])]
    with out.open("wb") as o, err.open("wb") as e:
        proc = subprocess.Popen(cmd, stdout=o, stderr=e, cwd=workdir.parent)
    try:
        _ready(proc, ports, [MODEL])
        while "ready (Ctrl-C" not in err.read_text() and proc.poll() is None:  # printed just after readiness
            time.sleep(0.2)
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except BaseException:
        _abort(proc)
        raise
    printed, said = out.read_text(), err.read_text()
    _stop_and_check(proc, descendants, signal.SIGINT)
    assert f"model {MODEL}: POST" in printed and len(printed.splitlines()) == 3, printed
    assert said.strip() == "ready (Ctrl-C or SIGTERM stops the server)", said


def test_python_backend_repository_loads_in_plain_tritonserver(workdir: Path, tmp_path: Path) -> None:
    repo = workdir / "package" / "triton-python"
    model = json.loads((workdir / "package" / "kiln-package.json").read_text())["models"][0]["triton_python_model"]
    ports = free_ports(3)
    log_file = tmp_path / "tritonserver.log"
    proc = tritonserver_process(repo, tmp_path / "scratch", *ports, log_file=log_file, reloadable=True)
    try:
        _ready(proc, ports, [model])
        descendants = psutil.Process(proc.pid).children(recursive=True)
        import tritonclient.http as httpclient

        engine_dir = workdir / "package" / "engines" / ENGINE
        feed = random_inputs(read_metadata(engine_dir).inputs, 5, seed=3)
        client = httpclient.InferenceServerClient(f"127.0.0.1:{ports[0]}")
        tensor = httpclient.InferInput("input", list(feed["input"].shape), "FP32")
        tensor.set_data_from_numpy(feed["input"])
        got = client.infer(model, [tensor]).as_numpy("logits")
        client.close()
        with load_engine(engine_dir) as runner:
            want = runner.infer(feed)["logits"]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        # gRPC, concurrent requests through the model's own batching of Triton's request lists
        result = loadtest(
            f"grpc://127.0.0.1:{ports[1]}", model, workdir, tmp_path / "lt", [4], duration_s=60, max_requests=40
        )
        assert result["levels"][0]["requests"] == 40 and result["levels"][0]["mismatches"] == 0
        # stopped as kiln serve stops it: the model unloaded first (its stub ends however busy the machine), then
        # SIGTERM, which Triton's exit timeout would otherwise bound with the stub still finishing (exit 1)
        assert drain_models(f"127.0.0.1:{ports[0]}", [model], STOP_TIMEOUT_S)
    except BaseException:
        _abort(proc)
        print(log_file.read_text()[-3000:])
        raise
    proc.terminate()
    assert proc.wait(timeout=STOP_TIMEOUT_S) == 0, log_file.read_text()[-3000:]
    _, alive = psutil.wait_procs(descendants, timeout=GONE_TIMEOUT_S)
    assert not alive


def test_port_in_use_is_a_clear_error(workdir: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(PortInUse, match=f"port {port}"):
            serve(workdir, http_port=port, grpc_port=free_port(), metrics_port=free_port())
        result = CliRunner().invoke(main, ["serve", str(workdir), "--grpc-port", str(port)])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines[0].startswith("error:") and "in use" in lines[0] and lines[1].startswith("fix:")


def test_an_engine_that_failed_validation_is_refused(workdir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "run"
    for stage in ("build", "validate"):
        shutil.copytree(workdir / stage, copy / stage)
    assert [e.model_name for e in find_engines(copy)] == [MODEL]  # build/ + a passing validation: served
    path = copy / "validate" / "validation.json"
    validation = json.loads(path.read_text())
    for e in validation["engines"]:
        e["passed"] = False
    path.write_text(json.dumps(validation))
    with pytest.raises(GateFailure, match="failed validation"):
        find_engines(copy)
    with pytest.raises(GateFailure, match="failed validation"):
        find_engines(copy / "build" / ENGINE)
    result = CliRunner().invoke(main, ["serve", str(copy / "build" / ENGINE)])
    assert result.exit_code == 3 and "error:" in result.output and "fix:" in result.output
    for e in validation["engines"]:  # built for a device the validating machine lacks: never run, not failed
        e["passed"] = None
    path.write_text(json.dumps(validation))
    with pytest.raises(GateFailure, match=f"engine {ENGINE} not validated on a machine that can run it") as refused:
        find_engines(copy)
    assert refused.value.hint.startswith("validate it where it runs")


def test_a_package_folder_shipped_apart_from_its_workdir_is_served(workdir: Path, tmp_path: Path) -> None:
    """A copy of package/ (the folder a user ships) was "holds no validated engines": it holds nothing else."""
    ship = tmp_path / "ship"
    shutil.copytree(workdir / "package", ship)
    assert [e.model_name for e in find_engines(ship)] == [MODEL]


def test_an_engine_no_validation_has_seen_is_served_with_a_warning(
    workdir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`kiln build`'s own folder (no validate/ beside it) is served, saying it is unchecked; a package's is not."""
    alone = tmp_path / "engine"
    shutil.copytree(workdir / "build" / ENGINE, alone)
    with caplog.at_level("WARNING", logger="kiln"):
        assert [e.model_name for e in find_engines(alone)] == [MODEL]
        find_engines(workdir / "package" / "engines" / ENGINE)
    said = [r.getMessage() for r in caplog.records if "has no validation record" in r.getMessage()]
    assert len(said) == 1 and ENGINE in said[0] and "keeping no record" in said[0], said


def test_the_stub_interpreter_sees_packages_this_process_found_through_pythonpath(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Python backend stub's interpreter ignores PYTHONPATH (like ``python -I``); the GPU host installs
    packages with ``--target`` + PYTHONPATH, and PyTriton's proxy then failed with "No module named 'zmq'"."""
    extra = tmp_path / "target-site"
    extra.mkdir()
    (extra / "kiln_probe_pkg.py").write_text("VALUE = 42\n")
    monkeypatch.syspath_prepend(str(extra))
    probe = ["-I", "-c", "import kiln_probe_pkg, kiln; print(kiln_probe_pkg.VALUE)"]
    plain = subprocess.run([sys.executable, *probe], check=False, capture_output=True, text=True)
    assert plain.returncode != 0 and "kiln_probe_pkg" in plain.stderr  # what the stub saw before
    env = stub_python_env(tmp_path / "scratch")
    seen = subprocess.run([str(env / "bin" / "python3"), *probe], check=False, capture_output=True, text=True)
    assert seen.returncode == 0 and seen.stdout.strip() == "42", seen.stderr  # kiln: an editable install's finder


def test_a_model_triton_cannot_load_is_one_error_and_no_server_left(
    workdir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import venv

    import kiln.serve.server

    bare = tmp_path / "bare"  # an interpreter without numpy: the stub cannot import Triton's backend utilities
    venv.EnvBuilder(symlinks=True, with_pip=False).create(bare)
    monkeypatch.setattr(kiln.serve.server, "stub_python_env", lambda scratch: bare)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(KilnError, match="Triton could not load model .*No module named") as info:
        serve(workdir, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
    assert "install the module" in info.value.hint
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    _, alive = psutil.wait_procs(left, timeout=GONE_TIMEOUT_S)
    assert not alive, f"left behind: {[p.pid for p in alive]}"


def test_padded_batches_give_the_rows_they_pad(workdir: Path) -> None:
    """Engines that build a session per input shape (ORT CUDA) serve padded batches of a few sizes: padding by
    repeating the last row, then cutting the answer, gives exactly the unpadded rows (here on the CPU engine)."""
    with load_engine(workdir / "build" / ENGINE) as runner:
        x = random_inputs(runner.meta.inputs, 5, seed=0)
        padded = pad_rows(x, 8)
        assert all(len(v) == 8 for v in padded.values())
        want, got = runner.infer(x), runner.infer(padded)
    for name, value in want.items():
        np.testing.assert_allclose(got[name][:5], value, rtol=1e-6, atol=1e-6)


def test_numpy_2_with_a_stub_that_predates_it_is_refused() -> None:
    """PyTriton 0.7.0's stub (Triton 2.51, pybind11 2.10) answers every request with empty outputs under numpy 2
    (seen on the GPU host): refused before serving, with the fix."""
    with pytest.raises(BackendUnavailable, match="numpy 2.1.3 is installed") as info:
        check_stub_numpy("2.1.3", "0.7.0")
    assert "numpy<2" in info.value.hint
    check_stub_numpy("1.26.4", "0.7.0")
    check_stub_numpy("2.1.3", "0.8.0")


def test_missing_server_package_names_the_extra(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pytriton", None)  # import pytriton now raises ImportError
    monkeypatch.setitem(sys.modules, "pytriton.triton", None)
    with pytest.raises(BackendUnavailable) as info:
        serve(workdir, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
    assert 'pip install "kiln[serve]"' in info.value.hint


def test_loadtest_without_a_server_is_a_clear_error(workdir: Path, tmp_path: Path) -> None:
    url, out = f"http://127.0.0.1:{free_port()}", str(tmp_path / "lt")  # nothing written where the tests run
    result = CliRunner().invoke(
        main, ["loadtest", url, "--model", MODEL, "-e", str(workdir), "--duration", "1", "-o", out]
    )
    assert result.exit_code == 2 and "error: cannot read model" in result.output and "fix:" in result.output


@pytest.mark.parametrize("url", ["http://10.1.2.3:8000", "http://example.com:8000", "ftp://127.0.0.1:1"])
def test_loadtest_targets_only_this_machine(url: str) -> None:
    with pytest.raises(ConfigError):
        parse_url(url)
    assert parse_url("grpc://127.0.0.1:8001") == ("grpc", "127.0.0.1:8001")


def _cuda_engine(workdir: Path, config: KilnConfig, tmp_path: Path, precision: str) -> tuple[Path, str]:
    """The run's model as a CUDA engine (its folder and served name): ONNX Runtime's where it has CUDA, else the
    torch backend's (a GPU host may have only one of them)."""
    import onnxruntime

    from kiln.models.model_io import load_trained
    from kiln.stages.engines.config import BuildConfig
    from kiln.stages.engines.stage import build_engine

    backend = "onnxruntime" if "CUDAExecutionProvider" in onnxruntime.get_available_providers() else "torch"
    engine_dir = tmp_path / f"{backend}-cuda-{precision}"
    build_engine(
        workdir / "optimize" / "model.onnx",
        engine_dir,
        backend,
        "cuda",
        precision,
        BuildConfig(backends=[backend]),
        tmp_path / "cache",
        max_batch=32,
        torch_model=lambda: load_trained(workdir / "train", config.model),
    )
    return engine_dir, engine_dir.name.replace("-", "_")


@pytest.mark.gpu
def test_cuda_fp16_engine_served_answers_match_under_load(workdir: Path, config: KilnConfig, tmp_path: Path) -> None:
    pytest.importorskip("tritonclient.grpc", reason="needs the serving libraries (pip install 'kiln[serve]')")
    engine_dir, model = _cuda_engine(workdir, config, tmp_path, "fp16")
    ports = free_ports(3)
    proc = _start_serve(engine_dir, ports, "--max-queue-delay-us", "2000")
    try:
        _ready(proc, ports, [model])
        descendants = psutil.Process(proc.pid).children(recursive=True)
        result = loadtest(
            f"grpc://127.0.0.1:{ports[1]}",
            model,
            engine_dir,
            tmp_path / "lt",
            [8],
            duration_s=120,
            max_requests=200,
        )
    except BaseException:
        _abort(proc)
        raise
    level = result["levels"][0]
    assert level["requests"] == 200 and level["mismatches"] == 0 and level["errors"] == 0, level
    assert result["server"]["execution_count"] < 200
    _stop_and_check(proc, descendants, signal.SIGTERM)


def test_a_stop_signal_is_a_flag_the_serving_loop_reads() -> None:
    """The first SIGINT/SIGTERM only sets a flag (an exception raised by a signal inside a finalizer is dropped:
    in CI a Ctrl-C landed in a multiprocessing connection's __del__ and the server never stopped); a second one
    raises KeyboardInterrupt."""
    from kiln.serve.server import _StopRequest, _wait

    class Alive:
        def __init__(self, alive: bool) -> None:
            self.alive = alive

        def is_alive(self) -> bool:
            return self.alive

    stop = _StopRequest()
    stop(signal.SIGTERM, None)
    _wait(Alive(True), stop)  # returns at once: stop was asked
    with pytest.raises(KeyboardInterrupt):
        stop(signal.SIGINT, None)
    with pytest.raises(KilnError, match="exited unexpectedly"):
        _wait(Alive(False), _StopRequest())


@pytest.mark.gpu
def test_gpus_all_serves_one_endpoint_over_every_gpu(workdir: Path, config: KilnConfig, tmp_path: Path) -> None:
    """`kiln serve --gpus all` on a CUDA engine: answers checked under load through one endpoint."""
    pytest.importorskip("tritonclient.grpc", reason="needs the serving libraries (pip install 'kiln[serve]')")
    engine_dir, model = _cuda_engine(workdir, config, tmp_path, "fp32")
    ports = free_ports(3)
    proc = _start_serve(engine_dir, ports, "--gpus", "all")
    try:
        _ready(proc, ports, [model])
        assert _max_batch(ports, model) == GPU_STUB_MAX_BATCH  # built for 32: a backlog spread over the stubs
        descendants = psutil.Process(proc.pid).children(recursive=True)
        result = loadtest(f"grpc://127.0.0.1:{ports[1]}", model, engine_dir, tmp_path / "lt", [8], 120, 200)
    except BaseException:
        _abort(proc)
        raise
    level = result["levels"][0]
    assert level["requests"] == 200 and level["mismatches"] == 0 and level["errors"] == 0, level
    _stop_and_check(proc, descendants, signal.SIGTERM)


def test_loadtest_takes_the_packages_model_names_given_an_engine_folder(workdir: Path) -> None:
    """`kiln loadtest -e <package>/engines/<engine> --model <the package's Triton name>` was refused with a list of
    names the server did not have; the workdir took the same name."""
    from kiln.serve.loadtest import engine_for

    record = json.loads((workdir / "package" / "kiln-package.json").read_text())["models"][0]
    folder = workdir / "package" / "engines" / record["engine"]
    for name in (record["triton_model"], record["triton_python_model"]):
        assert engine_for(folder, name).meta.name == engine_for(workdir, name).meta.name == record["engine"]
