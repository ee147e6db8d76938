"""The Ray Serve app's request handling, its replica class run in this process (no Ray cluster): an unbatched
engine takes whole batches, one engine call per request, while a batched one still batches requests; an empty or
wrongly ranked request is a 400 naming the problem, and the replica answers on."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kiln.core.records import EngineMetadata
from kiln.stages.engines.registry import load_engine
from tests.stages.engines.lstm_engine import lstm_engine

pytest.importorskip("ray.serve", reason="needs Ray Serve (pip install 'kiln[ray]'; part of .[dev])")

from ray import serve  # noqa: E402
from starlette.requests import Request  # noqa: E402

from kiln.serve import ray_app  # noqa: E402


def _request(x: np.ndarray) -> Request:
    """A KServe v2 JSON request of ``x`` as Ray's HTTP proxy hands it to the replica."""
    body = json.dumps(
        {"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]}
    )

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body.encode(), "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/v2/models/m/infer", "headers": [], "query_string": b""}
    return Request(scope, receive)


def _replica(engine: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, list[int]]:
    """The deployment's class as a replica would hold it, and the rows of each engine call it makes."""
    # @serve.batch reads the replica's max_ongoing_requests from Ray's replica context: a stand-in for it
    context = SimpleNamespace(_deployment_config=SimpleNamespace(max_ongoing_requests=64))
    monkeypatch.setattr(serve, "get_replica_context", lambda: context)
    monkeypatch.setattr(ray_app.gc, "freeze", lambda: None)  # the replica's, not this test process's
    cls = ray_app.KilnEngine.func_or_class
    # @serve.batch keeps one queue per method, bound to the event loop of its first call (a replica's process has
    # one): each test's asyncio.run is a new loop, so each test a new queue
    monkeypatch.setattr(cls.infer_batch.set_max_batch_size.__self__, "_queue", None)
    replica = cls(str(engine), "m", 32, 0.2)
    calls: list[int] = []
    run = replica._run
    monkeypatch.setattr(replica, "_run", lambda feed: calls.append(len(feed["input"])) or run(feed))
    return replica, calls


async def _answers(replica: Any, *batches: np.ndarray) -> list[tuple[int, dict[str, Any]]]:
    # a hang guard, not a speed test: an answer that never comes fails the test instead of stalling it
    responses = await asyncio.wait_for(asyncio.gather(*(replica(_request(x)) for x in batches)), timeout=60)
    return [(r.status_code, json.loads(r.body)) for r in responses]


def test_an_unbatched_engine_takes_each_request_whole_in_one_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, _ = lstm_engine(tmp_path, squeezed=True)  # forecast [batch]: Triton's max_batch_size 0
    replica, calls = _replica(engine, monkeypatch)
    assert replica.max_rows == 0
    batches = [np.random.default_rng(n).random((n, 4, 2), dtype=np.float32) for n in (1, 16, 200)]
    answers = asyncio.run(_answers(replica, *batches))
    with load_engine(engine) as runner:
        for x, (status, body) in zip(batches, answers):
            assert status == 200, body
            got = np.asarray(body["outputs"][0]["data"], np.float32)
            np.testing.assert_allclose(got, runner.infer({"input": x})["forecast"], rtol=1e-5, atol=1e-6)
    assert sorted(calls) == [1, 16, 200]  # one call per request, none joined


def test_a_batched_engine_still_joins_requests(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine, _ = lstm_engine(tmp_path, squeezed=False)  # forecast [batch, 3]
    replica, calls = _replica(engine, monkeypatch)
    assert replica.max_rows == 32
    answers = asyncio.run(_answers(replica, np.ones((2, 4, 2), np.float32), np.ones((3, 4, 2), np.float32)))
    assert [(s, body["outputs"][0]["shape"]) for s, body in answers] == [(200, [2, 3]), (200, [3, 3])]
    assert calls == [5]


def test_an_empty_request_is_a_400_naming_it_and_the_replica_answers_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, _ = lstm_engine(tmp_path)
    replica, calls = _replica(engine, monkeypatch)
    bad = {
        # 0 rows abort ONNX Runtime's LSTM kernel, and with it the replica
        "input 'input' has 0 rows": np.ones((0, 4, 2), np.float32),
        "input 'input' axis 1 (time) is 0": np.ones((3, 0, 2), np.float32),
    }
    answers = asyncio.run(_answers(replica, *bad.values(), np.ones((3, 4, 2), np.float32)))
    for message, (status, body) in zip(bad, answers):
        assert status == 400 and body["error"].startswith(message), (message, body)
    assert answers[-1][0] == 200 and calls == [3] and replica.failure is None


def test_a_request_of_the_wrong_rank_is_refused_for_its_rank() -> None:
    # the axis ranges name axes by position: a [24, 4] request to a [batch, time, 4] engine was blamed on its "time"
    meta = EngineMetadata(
        name="gru",
        backend="onnxruntime",
        device="cpu",
        precision="fp32",
        inputs=[{"name": "input", "shape": ["batch", "time", 4], "dtype": "float32"}],
        outputs=[{"name": "forecast", "shape": ["batch"], "dtype": "float32"}],
        source={"file": "m.onnx", "sha256": "0"},
        files={"model": "engine.onnx"},
        flavour="onnxruntime",
        versions={},
        axis_ranges={"time": [12, 24]},
    )
    tensor = {"name": "input", "shape": [24, 4], "datatype": "FP32", "data": [0.0] * 96}
    with pytest.raises(ray_app.BadRequest) as err:
        ray_app.parse_request({"inputs": [tensor]}, meta, 0)
    assert str(err.value) == "input 'input' has 2 axes [24, 4]; the model takes 3: [batch, time, 4]"
    tensor = {**tensor, "shape": [1, 24, 4]}
    assert ray_app.parse_request({"inputs": [tensor]}, meta, 0)["input"].shape == (1, 24, 4)
    with pytest.raises(ray_app.BadRequest, match=r"inputs \['input'\] given more than once"):
        ray_app.parse_request({"inputs": [tensor, tensor]}, meta, 0)
    with pytest.raises(ray_app.BadRequest, match="shape must be a list of sizes"):
        ray_app.parse_request({"inputs": [{**tensor, "shape": [True, 24, 4]}]}, meta, 0)


def test_infinite_and_nan_outputs_are_answered_not_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An output that is -inf on purpose (a masked class) or NaN is an answer: JSON's Infinity and NaN, which
    Python's json reads back, not starlette's 500 for values strict JSON lacks."""
    engine, _ = lstm_engine(tmp_path, squeezed=True)
    replica, _ = _replica(engine, monkeypatch)
    values = np.array([-np.inf, np.nan, 1.5], np.float32)
    monkeypatch.setattr(replica, "_attempt", lambda feed: {"forecast": values})
    [(status, body)] = asyncio.run(_answers(replica, np.zeros((3, 4, 2), np.float32)))
    got = np.asarray(body["outputs"][0]["data"], np.float32)
    assert status == 200 and np.isneginf(got[0]) and np.isnan(got[1]) and got[2] == 1.5
