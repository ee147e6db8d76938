"""A live Triton (`kiln serve`, and `kiln serve --pytriton`) serving an engine with a 0-d input and output: every
answer of `kiln loadtest` right, over HTTP, gRPC and (not for PyTriton, which restricts it) shared memory."""

from __future__ import annotations

import signal
from pathlib import Path

import psutil
import pytest

from kiln.serve.loadtest import loadtest
from kiln.serve.server import free_ports
from tests.serve.test_server import _abort, _ready, _start_serve, _stop_and_check
from tests.stages.package.test_triton_scalars import packaged  # noqa: F401 (the fixture)

pytestmark = pytest.mark.slow  # a Triton server per test, in its own process

MODEL = "onnxruntime_cpu_fp32"


@pytest.mark.parametrize("extra", [[], ["--pytriton"]], ids=["python-backend", "pytriton"])
def test_a_served_0d_input_and_output_are_answered_right_under_load(
    packaged,  # noqa: F811
    extra: list[str],
    tmp_path: Path,
) -> None:
    out, _, _ = packaged
    ports = free_ports(3)
    proc = _start_serve(out, ports, *extra)
    try:
        _ready(proc, ports, [MODEL])
        descendants = psutil.Process(proc.pid).children(recursive=True)
        urls = [(f"http://127.0.0.1:{ports[0]}", False), (f"grpc://127.0.0.1:{ports[1]}", False)]
        urls += [] if extra else [(f"http://127.0.0.1:{ports[0]}", True)]  # PyTriton restricts shared memory
        results = [
            loadtest(url, MODEL, out, tmp_path / f"lt{i}", [2], 60, 20, shared_memory=shm, metrics_port=ports[2])
            for i, (url, shm) in enumerate(urls)
        ]
    except BaseException:
        _abort(proc)
        raise
    _stop_and_check(proc, descendants, signal.SIGTERM)
    for result in results:
        level = result["levels"][0]
        assert level["requests"] == 20 and level["mismatches"] == 0 and level["errors"] == 0, level
