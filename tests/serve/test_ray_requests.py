"""The Ray Serve app's request handling, its replica class run in this process (no Ray cluster): an unbatched
engine takes whole batches, one engine call per request (a two-tower engine's texts and images in counts of their
own), while a batched one still batches requests; an empty or wrongly ranked request is a 400 naming the problem,
and the replica answers on. tritonclient.http's requests as it sends them by default (binary tensors) are answered
as it reads them; only the outputs asked for are answered; JSON values of another type than the input's are refused,
never cast."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.core.records import EngineMetadata
from kiln.stages.engines.backend import SIDECAR, read_metadata
from kiln.stages.engines.config import BuildConfig
from kiln.stages.engines.onnxruntime.config import OnnxRuntimeConfig
from kiln.stages.engines.registry import load_engine
from kiln.stages.engines.stage import build_engine
from tests.stages.engines.lstm_engine import lstm_engine
from tests.stages.engines.two_tower_engine import two_tower_engine, two_tower_feed

pytest.importorskip("ray.serve", reason="needs Ray Serve (pip install 'kiln[ray]'; part of .[dev])")

from ray import serve  # noqa: E402
from starlette.requests import Request  # noqa: E402

from kiln.serve import ray_app  # noqa: E402


def _request(x: np.ndarray) -> Request:
    """A KServe v2 JSON request of ``x`` as Ray's HTTP proxy hands it to the replica."""
    body = {"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]}
    return _http(json.dumps(body).encode())


def _http(body: bytes, headers: dict[str, str] | None = None) -> Request:
    """A POST to the replica's infer route of ``body`` with ``headers``, as Ray's HTTP proxy hands it over."""

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    fields = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    scope = {"type": "http", "method": "POST", "path": "/v2/models/m/infer", "headers": fields, "query_string": b""}
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
    monkeypatch.setattr(replica, "_run", lambda feed: calls.append(ray_app._rows(feed)) or run(feed))
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


def test_inputs_in_counts_of_their_own_are_taken_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A two-tower engine (``texts``, ``images``) is served unbatched: 5 texts with 2 images are one engine call,
    answered as the engine answers them."""
    engine, _ = two_tower_engine(tmp_path)
    replica, calls = _replica(engine, monkeypatch)
    assert replica.max_rows == 0
    feed = two_tower_feed(5, 2)
    tensors = [
        {"name": k, "shape": list(v.shape), "datatype": "FP32", "data": v.ravel().tolist()} for k, v in feed.items()
    ]
    [response] = asyncio.run(_responses(replica, _http(json.dumps({"inputs": tensors}).encode())))
    assert response.status_code == 200, response.body
    got = {
        o["name"]: np.asarray(o["data"], np.float32).reshape(o["shape"]) for o in json.loads(response.body)["outputs"]
    }
    with load_engine(engine) as runner:
        want = runner.infer(feed)
    assert {k: v.shape for k, v in got.items()} == {"text_embeds": (5, 3), "image_embeds": (2, 3)}
    for name, array in got.items():
        np.testing.assert_allclose(array, want[name], rtol=1e-6, atol=1e-6)
    assert calls == [5]


def _validated_at(engine: Path, batches: list[int]) -> None:
    """The engine's metadata as the package stage writes it for an engine validated at ``batches``."""
    meta = read_metadata(engine)
    meta.model_copy(update={"validated_batch_sizes": batches}).write(engine / SIDECAR)


@pytest.mark.parametrize("squeezed", [False, True])
def test_no_batch_past_the_largest_validated_is_formed_or_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, squeezed: bool
) -> None:
    """Validated at batches 1 and 8, the engine is served up to 8 rows whatever serve.yaml's max_batch_size (32): a
    request of more is a 400 saying so, batched or unbatched (a whole batch of the client's), and the replica
    answers on."""
    engine, _ = lstm_engine(tmp_path, squeezed=squeezed)
    _validated_at(engine, [1, 8])
    replica, calls = _replica(engine, monkeypatch)
    assert replica.max_rows == (0 if squeezed else 8)
    answers = asyncio.run(_answers(replica, np.ones((9, 4, 2), np.float32), np.ones((8, 4, 2), np.float32)))
    (refused, body), (answered, _) = answers
    assert (
        refused == 400
        and body["error"] == "input 'input' has 9 rows: engine onnxruntime-cpu-fp32 was validated for batches up to 8"
    )
    assert answered == 200 and calls == [8] and replica.failure is None


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


@pytest.fixture(scope="module")
def lookup(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An engine of two inputs and two outputs: ``ids`` INT64 [batch, 4] rows of a [20, 3] table -> ``embedding``
    [batch, 4, 3], and their sum times ``weight`` FP32 [batch, 1] -> ``logits`` [batch, 3]."""
    folder = tmp_path_factory.mktemp("lookup")
    table = numpy_helper.from_array(np.arange(60, dtype=np.float32).reshape(20, 3), "table")
    axes = numpy_helper.from_array(np.array([1], np.int64), "axes")
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["embedding"]),
        helper.make_node("ReduceSum", ["embedding", "axes"], ["sum"], keepdims=0),
        helper.make_node("Mul", ["sum", "weight"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "lookup",
        [
            helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", 4]),
            helper.make_tensor_value_info("weight", TensorProto.FLOAT, ["batch", 1]),
        ],
        [
            helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["batch", 4, 3]),
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 3]),
        ],
        [table, axes],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), folder / "m.onnx")
    cfg = BuildConfig(backends=["onnxruntime"], onnxruntime=OnnxRuntimeConfig(autotune={"cpu": False}))
    build_engine(folder / "m.onnx", folder / "e", "onnxruntime", "cpu", "fp32", cfg, folder / "cache")
    return folder / "e"


async def _responses(replica: Any, *requests: Request) -> list[Any]:
    return await asyncio.wait_for(asyncio.gather(*(replica(r) for r in requests)), timeout=60)  # a hang guard


def test_tritonclient_http_with_its_defaults_binary_tensors_is_answered(
    lookup: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``set_data_from_numpy`` sends binary tensors by default (KServe v2's binary tensor extension) and asks for
    binary outputs: the JSON header, then the raw bytes, its length in ``Inference-Header-Content-Length``."""
    httpclient = pytest.importorskip("tritonclient.http")
    client = httpclient.InferenceServerClient
    replica, _ = _replica(lookup, monkeypatch)
    rng = np.random.default_rng(0)
    ids, weight = rng.integers(0, 20, (2, 4)), rng.random((2, 1), dtype=np.float32)
    inputs = [httpclient.InferInput("ids", [2, 4], "INT64"), httpclient.InferInput("weight", [2, 1], "FP32")]
    inputs[0].set_data_from_numpy(ids)
    inputs[1].set_data_from_numpy(weight)
    asked = [  # the outputs asked for, and whether they come back binary
        (None, True),  # none named: all, binary (binary_data_output)
        ([httpclient.InferRequestedOutput("embedding")], True),
        ([httpclient.InferRequestedOutput("logits", binary_data=False)], False),
    ]
    requests = []
    for outputs, _ in asked:
        body, json_size = client.generate_request_body(inputs, outputs=outputs)
        assert json_size is not None  # binary data follows the JSON
        requests.append(_http(body, {"Inference-Header-Content-Length": str(json_size)}))
    responses = asyncio.run(_responses(replica, *requests))
    with load_engine(lookup) as runner:
        want = runner.infer({"ids": ids, "weight": weight})
    got = []
    for (_, binary), response in zip(asked, responses):
        assert response.status_code == 200, response.body
        header = response.headers.get("Inference-Header-Content-Length")
        result = client.parse_response_body(response.body, header_length=header)
        got.append({n: result.as_numpy(n) for n in ("embedding", "logits") if result.get_output(n)})
        sent = {o["name"]: "binary_data_size" in o.get("parameters", {}) for o in result.get_response()["outputs"]}
        assert sent == dict.fromkeys(got[-1], binary)
    assert [sorted(g) for g in got] == [["embedding", "logits"], ["embedding"], ["logits"]]
    for answer in got:
        for name, array in answer.items():
            np.testing.assert_array_equal(array, want[name])
            assert array.dtype == np.float32


def _meta(inputs: list[dict[str, Any]], outputs: list[dict[str, Any]]) -> EngineMetadata:
    return EngineMetadata(
        name="m",
        backend="onnxruntime",
        device="cpu",
        precision="fp32",
        inputs=inputs,
        outputs=outputs,
        source={"file": "m.onnx", "sha256": "0"},
        files={"model": "engine.onnx"},
        flavour="onnxruntime",
        versions={},
    )


LOOKUP = _meta(
    [
        {"name": "ids", "shape": ["batch", 4], "dtype": "int64"},
        {"name": "weight", "shape": ["batch", 1], "dtype": "float32"},
    ],
    [
        {"name": "embedding", "shape": ["batch", 4, 3], "dtype": "float32"},
        {"name": "logits", "shape": ["batch", 3], "dtype": "float32"},
    ],
)


def test_binary_tensor_data_that_does_not_add_up_is_a_400_naming_it() -> None:
    ids, weight = np.arange(8, dtype=np.int64).reshape(2, 4), np.ones((2, 1), np.float32)

    def body(
        ids_bytes: bytes = ids.tobytes(), size: int | None = None, tail: bytes = b"", **ids_extra: Any
    ) -> tuple[bytes, str]:
        """A request whose ``ids`` are ``ids_bytes`` (``size`` bytes said), then ``weight``'s bytes, then ``tail``."""
        params = {"binary_data_size": len(ids_bytes) if size is None else size}
        tensors = [
            {"name": "ids", "shape": [2, 4], "datatype": "INT64", "parameters": params} | ids_extra,
            {"name": "weight", "shape": [2, 1], "datatype": "FP32", "parameters": {"binary_data_size": 8}},
        ]
        head = json.dumps({"inputs": tensors}).encode()
        return head + ids_bytes + weight.tobytes() + tail, str(len(head))

    raw, length = body()
    feed, wanted = ray_app.read_request(raw, length, LOOKUP, 32)
    np.testing.assert_array_equal(feed["ids"], ids)
    np.testing.assert_array_equal(feed["weight"], weight)
    assert feed["ids"].flags.writeable and wanted == {"embedding": False, "logits": False}
    bad = {
        "needs the Inference-Header-Content-Length header": (raw, None),
        "binary_data=False": (raw, None),
        "Inference-Header-Content-Length '9999' is not a length": (raw, "9999"),
        "4 bytes of tensor data after the JSON belong to no input": body(tail=b"\0" * 4),
        "input 'weight': binary_data_size 8 from byte 68 runs past the 72 bytes": body(size=68),
        "input 'ids' has 60 bytes of binary data; shape [2, 4] of INT64 takes 64": body(ids.tobytes()[:60]),
        "input 'ids' has both \"data\" and binary_data_size": body(data=[0] * 8),
        "input 'ids' is in shared memory": body(parameters={"shared_memory_region": "r"}),
    }
    for message, (raw, length) in bad.items():
        with pytest.raises(ray_app.BadRequest) as err:
            ray_app.read_request(raw, length, LOOKUP, 32)
        assert message in str(err.value), (message, str(err.value))


def test_only_the_outputs_asked_for_are_answered_and_an_unknown_one_is_a_400(
    lookup: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    replica, calls = _replica(lookup, monkeypatch)
    inputs = [
        {"name": "ids", "shape": [1, 4], "datatype": "INT64", "data": [1, 2, 3, 4]},
        {"name": "weight", "shape": [1, 1], "datatype": "FP32", "data": [0.5]},
    ]
    asked = [None, [{"name": "embedding"}], [{"name": "logits"}, {"name": "embedding"}], [{"name": "nope"}]]
    bodies = [{"inputs": inputs} | ({"outputs": o} if o else {}) for o in asked]
    responses = asyncio.run(_responses(replica, *(_http(json.dumps(b).encode()) for b in bodies)))
    answers = [(r.status_code, json.loads(r.body)) for r in responses]
    names = [[o["name"] for o in body.get("outputs", [])] for _, body in answers]
    assert names[:3] == [["embedding", "logits"], ["embedding"], ["logits", "embedding"]]
    assert answers[3] == (400, {"error": "output 'nope' is not one of the model's outputs ['embedding', 'logits']"})
    assert answers[1][1]["outputs"][0]["data"] == np.arange(3, 15).tolist()
    with pytest.raises(ray_app.BadRequest, match=r"outputs \['logits'\] asked for more than once"):
        ray_app.requested_outputs({"outputs": [{"name": "logits"}, {"name": "logits"}]}, LOOKUP)
    with pytest.raises(ray_app.BadRequest, match="binary_data must be true or false, not 1"):
        ray_app.requested_outputs({"outputs": [{"name": "logits", "parameters": {"binary_data": 1}}]}, LOOKUP)


TYPED = _meta(
    [
        {"name": "ids", "shape": ["batch", 2], "dtype": "int64"},
        {"name": "x", "shape": ["batch", 2], "dtype": "float32"},
        {"name": "mask", "shape": ["batch", 2], "dtype": "bool"},
        {"name": "small", "shape": ["batch", 2], "dtype": "uint8"},
    ],
    [{"name": "y", "shape": ["batch"], "dtype": "float32"}],
)


def _typed(**data: list[Any]) -> dict[str, Any]:
    """A request to ``TYPED`` of one row, ``data`` in place of good values."""
    good = {"ids": [1, 2], "x": [0.5, 1], "mask": [True, False], "small": [0, 255]}
    types = {"ids": "INT64", "x": "FP32", "mask": "BOOL", "small": "UINT8"}
    return {
        "inputs": [{"name": n, "shape": [1, 2], "datatype": types[n], "data": data.get(n, v)} for n, v in good.items()]
    }


def test_json_values_of_another_type_than_the_input_are_refused_never_cast(
    lookup: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As Triton's front end: integers (not true, not 1.0) for integer types, numbers (not null, not strings) for
    floats, true and false for BOOL; the 400 names the input and the first value it refuses."""
    feed = ray_app.parse_request(_typed(x=[[2, 0.25]]), TYPED, 32)  # nested lists are read row-major
    assert feed["x"].tolist() == [[2.0, 0.25]] and feed["x"].dtype == np.float32
    assert feed["mask"].tolist() == [[True, False]] and feed["small"].tolist() == [[0, 255]]
    bad = {
        "input 'ids' is INT64, which takes JSON integers: value 1 is 1.7": _typed(ids=[1, 1.7]),
        "input 'ids' is INT64, which takes JSON integers: value 0 is true": _typed(ids=[True, 2]),
        "input 'ids' is INT64, which takes JSON integers: value 1 is 2.0": _typed(ids=[1, 2.0]),
        "input 'x' is FP32, which takes JSON numbers: value 0 is null": _typed(x=[None, 1]),
        "input 'x' is FP32, which takes JSON numbers: value 1 is \"0.5\"": _typed(x=[1, "0.5"]),
        "input 'x' is FP32, which takes JSON numbers: value 0 is false": _typed(x=[False, 1]),
        "input 'mask' is BOOL, which takes true or false: value 1 is 0": _typed(mask=[True, 0]),
        "input 'small' is UINT8, which takes integers in [0, 255]: value 1 is 256": _typed(small=[0, 256]),
        "input 'small' is UINT8, which takes integers in [0, 255]: value 0 is -1": _typed(small=[-1, 0]),
        f"input 'ids' is INT64, which takes integers in [{-(2**63)}, {2**63 - 1}]: value 1 is {2**63}": _typed(
            ids=[0, 2**63]
        ),
        "input 'x' is FP32: value 1 is past any float": _typed(x=[1, 10**400]),
        "input 'ids' has 3 values; shape [1, 2] takes 2": _typed(ids=[1, 2, 3]),
        "input 'ids' has no data list": _typed(ids=None),
    }
    for message, body in bad.items():
        with pytest.raises(ray_app.BadRequest) as err:
            ray_app.parse_request(body, TYPED, 32)
        assert str(err.value).startswith(message), (message, str(err.value))
    # over HTTP: a 400, where 1.7 was read as 1 and answered
    replica, calls = _replica(lookup, monkeypatch)
    inputs = [
        {"name": "ids", "shape": [1, 4], "datatype": "INT64", "data": [1.7, 2, 3, 4]},
        {"name": "weight", "shape": [1, 1], "datatype": "FP32", "data": [0.5]},
    ]
    [response] = asyncio.run(_responses(replica, _http(json.dumps({"inputs": inputs}).encode())))
    assert response.status_code == 400 and "value 0 is 1.7" in json.loads(response.body)["error"] and not calls


def _get(path: str) -> Request:
    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    return Request({"type": "http", "method": "GET", "path": path, "headers": [], "query_string": b""}, receive)


def test_the_server_health_routes_are_ready_only_when_every_engine_application_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """GET /v2/health/ready (tritonclient's is_server_ready, a Kubernetes probe) follows Serve's own status of the
    engines' applications; the health application's own status is not waited on."""
    from ray.serve.schema import ApplicationStatus

    statuses = {"kiln_a": ApplicationStatus.RUNNING, "kiln_b": ApplicationStatus.DEPLOYING}
    statuses[ray_app.HEALTH_APP] = ApplicationStatus.DEPLOYING
    apps = {name: SimpleNamespace(status=s) for name, s in statuses.items()}
    monkeypatch.setattr(serve, "status", lambda: SimpleNamespace(applications=apps))
    health = ray_app.ServerHealth.func_or_class()
    call = lambda path: asyncio.run(health(_get(path)))  # noqa: E731
    assert call("/v2/health/live").status_code == 200
    waiting = call("/v2/health/ready")
    assert waiting.status_code == 503 and json.loads(waiting.body) == {"error": "not ready: kiln_b DEPLOYING"}
    apps["kiln_b"].status = ApplicationStatus.RUNNING
    assert call("/v2/health/ready").status_code == 200
    assert call("/v2/health/other").status_code == 404
