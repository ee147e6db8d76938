"""The Ray Serve application the package stage writes, started as written from a copy of the package (`serve run
ray/serve.yaml`, a local Ray cluster), driven by `kiln loadtest ray://` and by tritonclient.http's defaults (binary
tensors), answers checked against the engine; bad requests answered with errors naming the problem while it keeps
answering; a replica whose process dies is replaced, and the log says so."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import yaml

from kiln.pipeline.api import run_pipeline
from kiln.pipeline.config import config_from_dict
from kiln.serve.loadtest import loadtest
from kiln.serve.server import free_port
from tests.conftest import tiny_config_dict

pytest.importorskip("ray.serve", reason="needs Ray Serve (pip install 'kiln[ray]'; part of .[dev])")
pytestmark = pytest.mark.slow  # a local Ray cluster (~20 s to start on 2 cores)
# A hang guard below pytest's own (1800 s), not a speed test: it returns as soon as the application answers. Beside
# 7 busy loops and 7 other test workers a local Ray cluster took over 5 minutes to start its HTTP proxy.
READY_TIMEOUT_S = 1500


def _post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """POST a JSON body; the status and the answer (an error's text that is not JSON as ``{"error": text}``)."""
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=READY_TIMEOUT_S) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        text = exc.read().decode(errors="replace")
        try:
            return exc.code, json.loads(text)
        except ValueError:
            return exc.code, {"error": text}


def _replicas(deployment: str) -> list[psutil.Process]:
    """The processes of a deployment's replicas: Ray titles them ``ray::ServeReplica:<app>:<deployment>``, with
    ``.<method>()`` after it while the replica runs a method (a request, a health check)."""
    title = re.compile(rf"ServeReplica:[^\s:]+:{re.escape(deployment)}(?!\w)")
    return [p for p in psutil.process_iter(["cmdline"]) if title.search(" ".join(p.info["cmdline"] or []))]


# `serve run` itself (Ray's own command-line entry point) with one change: its wait for the HTTP proxy, a constant
# of 60 s in Ray Serve (not configurable), gets the test's hang-guard limit. On 2 cores at a load average of 10 the
# proxy's worker process took longer than 60 s to start, and `serve run` exited.
SERVE_RUN = f"""
import sys
import ray.serve._private.api as api
from ray.serve.scripts import cli
api.HTTP_PROXY_TIMEOUT = {READY_TIMEOUT_S}
cli(sys.argv[1:], prog_name="serve")
"""


def _wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1)
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
    raise AssertionError(f"the Ray Serve app did not become ready (serve run exit code {proc.poll()}):\n{tail}")


def _wait_for_lines(log: Path, wanted: list[str]) -> None:
    """Wait until ``serve run``'s log (streamed from Ray's processes) holds every one of ``wanted``."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        text = log.read_text(errors="replace")
        missing = [w for w in wanted if w not in text]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"not in serve run's log: {missing}")
        time.sleep(1)


@pytest.mark.long
def test_the_packaged_ray_app_serves_checked_answers_refuses_bad_requests_and_replaces_a_dead_replica(
    tmp_path: Path,
) -> None:
    config = config_from_dict(tiny_config_dict())
    workdir = tmp_path / "run"
    result, _ = run_pipeline(config, workdir)
    assert result.ok
    # served from a copy of the package (serve.yaml names its engines relative to the package folder)
    shipped = tmp_path / "shipped"
    shutil.copytree(workdir / "package", shipped)
    serve_yaml = yaml.safe_load((shipped / "ray" / "serve.yaml").read_text())
    port = free_port()
    serve_yaml["http_options"]["port"] = port  # the only change: a free port for the test
    app = next(
        a for a in serve_yaml["applications"] if a["args"].get("engine_dir", "").endswith("onnxruntime-cpu-fp32")
    )
    health = next(a for a in serve_yaml["applications"] if a["route_prefix"] == "/v2/health")
    serve_yaml["applications"] = [app, health]  # one engine's application and the server's health routes
    (shipped / "ray" / "serve.yaml").write_text(yaml.safe_dump(serve_yaml))
    model = app["args"]["model_name"]
    base = f"http://127.0.0.1:{port}/v2/models/{model}"
    # Ray Serve's own checks that its HTTP proxy started (5 s, 10 s, three tries) kill the proxy of a loaded 2-core
    # machine before it answers, and `serve run` exits: they get the test's hang-guard limit. (`serve run`'s own 60 s
    # wait for the proxy is fixed in Ray: SERVE_RUN raises it.)
    # Ray starts its worker processes (the proxy, the replicas, the app's build task) at niceness 15: beside any busy
    # process at 0 they get a few percent of a core and take minutes each to start. Niceness 0 lets them take their
    # share of the machine, as the test's other processes do.
    env = {
        **os.environ,
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_worker_niceness": "0",
        "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": str(READY_TIMEOUT_S),
        "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": str(READY_TIMEOUT_S),
    }
    log = tmp_path / "serve-run.log"
    with open(log, "wb") as out:
        cmd = [sys.executable, "-c", SERVE_RUN, "run", "ray/serve.yaml"]  # started in the package folder
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=out, cwd=shipped)
    try:
        _wait_ready(f"{base}/ready", proc, log)
        _wait_ready(f"http://127.0.0.1:{port}/v2/health/ready", proc, log)  # the server's, once every app runs
        lt = loadtest(f"ray://127.0.0.1:{port}", model, workdir, tmp_path / "lt", [4], 60, 40, config=config)
        level = lt["levels"][0]
        assert level["requests"] == 40 and level["mismatches"] == 0 and level["errors"] == 0, level
        assert lt["server_kind"] == "Ray Serve" and level["served_vs_inprocess"] > 0
        assert (tmp_path / "lt" / "loadtest.png").stat().st_size > 0
        good = {"name": "input", "shape": [1, 1, 8, 8], "datatype": "FP32", "data": [0.5] * 64}
        bad = {
            "has shape [1, 1, 8, 9]": {**good, "shape": [1, 1, 8, 9], "data": [0.5] * 72},
            "is INT64; the model takes FP32": {**good, "datatype": "INT64"},
            "validated for batches up to 8": {**good, "shape": [9, 1, 8, 8], "data": [0.5] * 64 * 9},
            "the model takes ['input']": {**good, "name": "x"},
        }
        for message, tensor in bad.items():
            status, body = _post(f"{base}/infer", {"inputs": [tensor]})
            assert status == 400 and message in body["error"], (status, body)
        status, body = _post(f"{base}/infer", {"inputs": [good]})  # still answering after the bad ones
        assert status == 200 and np.asarray(body["outputs"][0]["data"]).shape == (10,)
        want = body["outputs"][0]["data"]
        # tritonclient.http with its defaults: binary tensors both ways (KServe v2's binary tensor extension)
        import tritonclient.http as httpclient

        tensor = httpclient.InferInput("input", [1, 1, 8, 8], "FP32")
        tensor.set_data_from_numpy(np.full((1, 1, 8, 8), 0.5, np.float32))
        client = httpclient.InferenceServerClient(f"127.0.0.1:{port}", network_timeout=READY_TIMEOUT_S)
        assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(model)
        result = client.infer(model, [tensor])
        assert np.allclose(result.as_numpy(body["outputs"][0]["name"]).ravel(), want)
        # A dead replica: its process killed. The server keeps answering (an error naming the problem, or the answer
        # once Ray has replaced the replica), and the replacement is in the log, not silent.
        (dead,) = _replicas(model)
        dead.kill()
        dead.wait(timeout=60)
        answers = [_post(f"{base}/infer", {"inputs": [good]}) for _ in range(3)]
        for status, body in answers:
            assert status == 200 or (status >= 500 and body.get("error")), (status, body)
        status, body = answers[-1]
        assert status == 200 and np.allclose(body["outputs"][0]["data"], want), (status, body)
        assert [p.pid for p in _replicas(model)] not in ([], [dead.pid]), "no replacement replica runs"
        _wait_for_lines(log, ["crashed, marking it unhealthy", "Adding 1 replica"])
    finally:
        proc.send_signal(signal.SIGINT)  # serve run shuts its applications and local Ray cluster down
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
