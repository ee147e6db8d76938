"""A 0-d input or output (a mixture-of-experts model's scalar ``aux_loss``) is declared to Triton as ``dims: [ 1 ]``:
``kiln loadtest`` sends such an input as ``[1]`` (in the request, or laid out in shared memory) and holds the ``[1]``
answer to the engine's ``[]``; Ray Serve's application keeps the engine's shapes. No server is started: stand-ins
answer as Triton does, refusing ``[]`` where it declares ``[1]``."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import kiln.serve.loadtest as loadtest

DECLARED = {"x": [1, 4], "scale": [1]}  # what Triton takes: the package stage's dims for x [batch, 4], scale []


def _pool() -> tuple[list[dict], list[dict]]:
    """Eight requests of x [1, 4] and a 0-d scale, and the engine's answers: y [1, 4], total []."""
    pool = [{"x": np.full((1, 4), k, np.float32), "scale": np.array(2.0, np.float32)} for k in range(8)]
    expected = [{"y": f["x"] * 2, "total": np.array(f["x"].sum(), np.float32)} for f in pool]
    return pool, expected


class _Result:
    def __init__(self, answer: dict[str, np.ndarray]) -> None:
        self.answer = answer

    def as_numpy(self, name: str) -> np.ndarray:
        return self.answer[name]


class _Triton:
    """tritonclient's client of a Triton serving the package's config: an input not of its declared shape is
    refused as Triton refuses it; the 0-d ``total`` answered as ``[1]``."""

    def __init__(self, sent: list[dict]) -> None:
        self.sent = sent

    def infer(self, model: str, inputs: dict[str, np.ndarray], **_: object) -> _Result:
        self.sent.append({n: list(a.shape) for n, a in inputs.items()})
        for name, array in inputs.items():
            if list(array.shape) != DECLARED[name]:
                raise RuntimeError(f"unexpected shape for input '{name}', Expected {DECLARED[name]}, got {array.shape}")
        x = inputs["x"] * inputs["scale"].reshape(-1)[0]
        return _Result({"y": x, "total": np.array([inputs["x"].sum()], np.float32)})

    def close(self) -> None:
        pass


def _level(monkeypatch: pytest.MonkeyPatch, protocol: str, sent: list[dict]) -> loadtest.Level:
    module = SimpleNamespace(InferRequestedOutput=lambda name, binary_data: name)  # Ray Serve's are asked for
    monkeypatch.setattr(loadtest, "_client_module", lambda protocol: module)
    monkeypatch.setattr(loadtest, "_client", lambda module, protocol, address: (_Triton(sent), {}))
    monkeypatch.setattr(loadtest, "_inputs", lambda module, feed, binary=True: feed)
    pool, expected = _pool()
    return loadtest.run_level(protocol, "127.0.0.1:1", "m", pool, expected, loadtest.TOLERANCE["fp32"], 1, 30.0, 8)


def test_a_0d_input_is_sent_to_triton_as_1_and_a_0d_answer_of_1_is_right(monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[dict] = []
    level = _level(monkeypatch, "http", sent)
    assert level.errors == [] and (level.mismatches, len(level.latencies_ms)) == (0, 8), level.errors
    assert sent[0] == {"x": [1, 4], "scale": [1]}


def test_ray_serve_gets_the_engines_own_0d_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Ray Serve application checks each input's rank against the engine's: a 0-d input stays ``[]``."""
    sent: list[dict] = []
    monkeypatch.setitem(DECLARED, "scale", [])
    _level(monkeypatch, "ray", sent)
    assert sent[0] == {"x": [1, 4], "scale": []}


def test_an_answer_is_compared_in_the_engines_shape_only_where_the_engine_gives_a_0d_one() -> None:
    assert loadtest.as_expected(np.array([3.0]), np.array(3.0)).shape == ()
    assert loadtest.as_expected(np.array([[3.0]]), np.array(3.0)).shape == ()
    assert loadtest.as_expected(np.array([3.0, 4.0]), np.array(3.0)).shape == (2,)  # wrong, and said so
    assert loadtest.as_expected(np.array([3.0]), np.array([[3.0]])).shape == (1,)  # no other shape is forgiven


class _Regions:
    """A Triton's shared-memory registry that takes every region."""

    def register_system_shared_memory(self, name: str, key: str, size: int) -> None:
        pass

    def unregister_system_shared_memory(self, name: str) -> None:
        pass

    def get_system_shared_memory_status(self) -> list[dict]:
        return []

    def close(self) -> None:
        pass


class _LeanTriton:
    """Kiln's HTTP client of a Triton that checks each input's declared shape in the request's JSON and answers in
    the output regions (left zero: the expected answers are zeros), ``total`` declared ``[1]``."""

    sent: list[dict[str, Any]] = []

    def __init__(self, address: str, timeout_s: float) -> None:
        pass

    def send(self, request: bytes) -> dict[str, Any]:
        body = json.loads(request.split(b"\r\n\r\n", 1)[1])
        shapes = {t["name"]: t["shape"] for t in body["inputs"]}
        self.sent.append(shapes)
        if shapes != DECLARED:
            raise loadtest.HttpError(f"unexpected shapes {shapes}, expected {DECLARED}")
        return {"outputs": [{"name": "y", "shape": [1, 4]}, {"name": "total", "shape": [1]}]}

    def close(self) -> None:
        pass


def test_a_0d_input_laid_out_in_shared_memory_is_declared_1(monkeypatch: pytest.MonkeyPatch) -> None:
    module = pytest.importorskip("tritonclient.http", reason="needs the serving libraries (pip install 'kiln[serve]')")
    monkeypatch.setattr(loadtest, "_client_module", lambda protocol: module)
    monkeypatch.setattr(loadtest, "_client", lambda module, protocol, address: (_Regions(), {}))
    monkeypatch.setattr(loadtest, "HttpClient", _LeanTriton)
    monkeypatch.setattr(_LeanTriton, "sent", [])
    pool, _ = _pool()
    expected = [{"y": np.zeros((1, 4), np.float32), "total": np.array(0.0, np.float32)} for _ in pool]
    tolerance = loadtest.TOLERANCE["fp32"]
    level = loadtest.run_level("http", "127.0.0.1:1", "m", pool, expected, tolerance, 1, 30.0, 8, shared_memory=True)
    assert level.client == "kiln" and level.errors == [], level.errors
    assert (level.mismatches, len(level.latencies_ms)) == (0, 8)
    assert _LeanTriton.sent[0] == DECLARED
