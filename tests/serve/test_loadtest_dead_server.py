"""`kiln loadtest` against a server that ends in the middle of a level or refuses every request: what the client
does, so a small KServe v2 JSON server in a subprocess stands in for Triton (the ray:// protocol: tensors as JSON)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.core.errors import KilnError
from kiln.serve.http_client import HttpError
from kiln.serve.loadtest import GONE_AFTER, loadtest, no_server
from kiln.stages.engines.config import BuildConfig
from kiln.stages.engines.stage import build_direct

MODEL = "onnxruntime_cpu_fp32"

# argv: count file, then "die N" (answer N requests, then end the process as a crash would) or "refuse" (answer every
# request as Triton answers one for a model of other inputs)
SERVER = r"""
import json, os, socket, sys, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

count_file, mode, *rest = sys.argv[1:]
seen, lock = [0], threading.Lock()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def setup(self):
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # head and body: no 40 ms wait

    def do_GET(self):
        self.reply(200, {})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with lock:
            seen[0] += 1
            n = seen[0]
            with open(count_file, "w") as f:
                f.write(str(n))
            if mode == "die" and n > int(rest[0]):
                os._exit(0)
        if mode == "refuse":
            return self.reply(400, {"error": "[request id: <id_unknown>] missing required input(s) 'attention_mask'"})
        x = body["inputs"][0]
        y = {"name": "y", "datatype": "FP32", "shape": x["shape"], "data": [2 * v for v in x["data"]]}
        self.reply(200, {"model_name": self.path.split("/")[3], "outputs": [y]})

    def reply(self, status, answer):
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An ONNX Runtime CPU engine of y = 2 x, x [batch, 4]: what the fake server computes."""
    folder = tmp_path_factory.mktemp("double")
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "two"], ["y"], name="double")],
        "double",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        [numpy_helper.from_array(np.array(2.0, np.float32), "two")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), folder / "m.onnx")
    build_direct(folder / "m.onnx", folder / "engine", "onnxruntime", "cpu", None, BuildConfig())
    return folder / "engine"


@pytest.fixture
def serve(tmp_path: Path) -> Iterator:
    """Starts the fake server with the given mode; yields its URL and a reader of the requests it was sent."""
    started: list[subprocess.Popen] = []
    count = tmp_path / "requests.txt"

    def start(*mode: str) -> tuple[str, callable]:
        proc = subprocess.Popen([sys.executable, "-c", SERVER, str(count), *mode], stdout=subprocess.PIPE, text=True)
        started.append(proc)
        port = int(proc.stdout.readline())
        return f"ray://127.0.0.1:{port}", lambda: int(count.read_text()) if count.is_file() else 0

    yield start
    for proc in started:
        proc.kill()
        proc.wait(timeout=10)


LONG_LEVEL_S = 300.0  # a level far longer than the test's server lives


def _run(url: str, engine: Path, out: Path, duration_s: float = 30.0) -> dict:
    return loadtest(url, MODEL, engine, out, [2], duration_s, inprocess=False, metrics_port=None)


def test_a_server_that_ends_mid_level_stops_the_level_and_its_row_says_so(engine: Path, serve, tmp_path: Path) -> None:
    url, sent = serve("die", "300")
    t0 = time.monotonic()
    with pytest.raises(KilnError, match="the server stopped answering .* into the level at concurrency 2") as err:
        _run(url, engine, tmp_path / "lt", duration_s=LONG_LEVEL_S)
    # a hang guard, not a speed test: 300 answers take seconds even on a busy machine, the level would take 300
    assert time.monotonic() - t0 < LONG_LEVEL_S / 2, "the level ran on after the server ended"
    assert "found no server" in err.value.message and "Connection refused" in err.value.message
    level = json.loads((tmp_path / "lt" / "loadtest.json").read_text())["levels"][0]
    # 300 answers, the first alone before the level; the last may be lost as the server exits while writing it
    assert level["server_gone"] and level["requests"] in (298, 299), level
    # each client cut off in flight (its connection closed), then refused GONE_AFTER times in all: no spin (a level
    # that went on retrying the dead server counted thousands)
    assert level["errors"] <= 2 * (GONE_AFTER + 4), level["error_examples"]
    assert level["seconds"] < LONG_LEVEL_S / 2 and level["throughput_rps"] == pytest.approx(
        level["requests"] / level["seconds"]
    )
    assert sent() == 301  # the server ended on the next request, and none came after
    md = (tmp_path / "lt" / "loadtest.md").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| 2 |"))
    assert f"{level['throughput_rps']:.1f} (server stopped)" in row, md
    assert f"the server stopped answering {level['seconds']:.1f} s into the level" in md, md


def test_a_server_that_refuses_the_first_request_is_quoted_before_any_level(
    engine: Path, serve, tmp_path: Path
) -> None:
    url, sent = serve("refuse")
    with pytest.raises(KilnError, match="missing required input") as err:
        _run(url, engine, tmp_path / "lt")
    assert err.value.exit_code == 2 and "the first request to model" in err.value.message
    assert "-e" in err.value.hint and sent() == 1 and not (tmp_path / "lt" / "loadtest.json").exists()


def test_a_request_that_found_no_server_is_told_from_one_the_server_answered() -> None:
    class Unavailable(Exception):
        def status(self) -> str:
            return "StatusCode.UNAVAILABLE"

    class Refused(Exception):
        def status(self) -> str:
            return "400"

    def kilns_client_error(cause: OSError) -> HttpError:
        try:
            raise cause
        except OSError:
            try:
                raise HttpError("connection to 127.0.0.1:1 failed") from None
            except HttpError as exc:
                return exc

    assert no_server(ConnectionRefusedError(111, "Connection refused")) and no_server(Unavailable())
    assert no_server(kilns_client_error(ConnectionRefusedError(111, "Connection refused")))
    assert not no_server(Refused("missing required input(s)")) and not no_server(HttpError("bad input"))
    assert not no_server(TimeoutError("timed out")) and not no_server(kilns_client_error(TimeoutError()))
