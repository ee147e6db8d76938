"""Padded batches for shape-specialised engines: the sizes, the padding, the answer cut back to the rows asked for,
and which runners get it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from kiln.serve import batching
from kiln.serve.batching import batch_buckets, batched_infer, buckets_for, padded_infer, warm_buckets
from kiln.stages.engines.backend import HOST_INPUT_SHAPES
from kiln.stages.engines.config import BuildConfig
from kiln.stages.engines.onnxruntime.config import OnnxRuntimeConfig
from kiln.stages.engines.registry import load_engine
from kiln.stages.engines.stage import build_engine


class Doubler:
    """A runner whose answer is its input doubled, recording the batch sizes it ran (what a padded call costs)."""

    def __init__(self, per_shape: bool) -> None:
        self.per_shape_sessions, self.ran = per_shape, []

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, Any]:
        x = inputs["x"]
        self.ran.append(len(x))
        return {"y": x * 2}


class _Spec:
    def __init__(self, shape: list[Any]) -> None:
        self.name, self.shape, self.dtype = "x", shape, "float32"


class _Meta:
    def __init__(self, shape: list[Any]) -> None:
        self.inputs = [_Spec(shape)]


def test_buckets_are_powers_of_two_up_to_the_largest_batch() -> None:
    assert batch_buckets(32) == [1, 2, 4, 8, 16, 32] and batch_buckets(24) == [1, 2, 4, 8, 16, 24]
    assert batch_buckets(1) == [1]


def test_only_shape_specialised_engines_with_a_batch_axis_are_padded() -> None:
    assert buckets_for(Doubler(per_shape=True), 8) == [1, 2, 4, 8]
    assert buckets_for(Doubler(per_shape=False), 8) is None
    assert buckets_for(Doubler(per_shape=True), 0) is None  # served without a batch axis


def test_a_padded_call_answers_exactly_the_rows_asked_for() -> None:
    runner = Doubler(per_shape=True)
    x = np.arange(5 * 3, dtype=np.float32).reshape(5, 3)
    out = padded_infer(runner, {"x": x}, [1, 2, 4, 8])
    assert runner.ran == [8] and out["y"].shape == (5, 3)
    np.testing.assert_array_equal(out["y"], x * 2)
    assert padded_infer(runner, {"x": x[:4]}, [1, 2, 4, 8])["y"].shape == (4, 3) and runner.ran[-1] == 4
    assert padded_infer(runner, {"x": x}, None)["y"].shape == (5, 3) and runner.ran[-1] == 5


def test_every_bucket_is_built_before_ready_unless_an_axis_besides_the_batch_is_dynamic() -> None:
    runner = Doubler(per_shape=True)
    assert warm_buckets(runner, _Meta([-1, 3]), [1, 2, 4]) and runner.ran == [1, 2, 4]
    assert not warm_buckets(runner, _Meta([-1, "seq"]), [1, 2, 4]) and runner.ran == [1, 2, 4]


@pytest.fixture(scope="module")
def doubling_engine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real ONNX Runtime CPU engine of ``y = 2 x``, x of shape [batch, 3]."""
    work = tmp_path_factory.mktemp("doubling")
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "x"], ["y"])],
        "double",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), work / "double.onnx")
    cfg = BuildConfig(backends=["onnxruntime"], onnxruntime=OnnxRuntimeConfig(autotune={"cpu": False}))
    build_engine(work / "double.onnx", work / "e", "onnxruntime", "cpu", "fp32", cfg, work / "cache")
    return work / "e"


def test_requests_batched_into_the_runners_kept_buffer_each_get_their_own_rows(doubling_engine: Path) -> None:
    requests = [{"x": np.full((n, 3), i, np.float32)} for i, n in enumerate([1, 2], start=1)]
    with load_engine(doubling_engine) as runner:
        answers = batched_infer(runner, requests, [1, 2, 4, 8])
        assert [a["y"].shape for a in answers] == [(1, 3), (2, 3)]
        for request, answer in zip(requests, answers):
            np.testing.assert_array_equal(answer["y"], request["x"] * 2)
        kept = runner.host_inputs({"x": (4, 3)})  # 3 rows padded to 4: the last row repeated
        np.testing.assert_array_equal(kept["x"], [[1] * 3, [2] * 3, [2] * 3, [2] * 3])
        again = batched_infer(runner, [{"x": np.full((3, 3), 5, np.float32)}], [1, 2, 4, 8])
        assert runner.host_inputs({"x": (4, 3)}) is kept and (again[0]["y"] == 10).all()
        # without buckets the batch runs at its own size
        assert batched_infer(runner, requests, None)[1]["y"].shape == (2, 3)
        assert runner.host_inputs({"x": (3, 3)})["x"].shape == (3, 3)


def test_requests_whose_other_dimensions_differ_are_refused(doubling_engine: Path) -> None:
    with load_engine(doubling_engine) as runner, pytest.raises(ValueError):
        batched_infer(runner, [{"x": np.ones((1, 3), np.float32)}, {"x": np.ones((1, 4), np.float32)}], None)


def test_a_runner_keeps_buffers_for_its_most_recent_shapes_until_deactivated(doubling_engine: Path) -> None:
    runner = load_engine(doubling_engine).activate()
    first = runner.host_inputs({"x": (1, 3)})
    assert first["x"].dtype == np.float32 and first["x"].flags.writeable
    for rows in range(2, HOST_INPUT_SHAPES + 2):
        runner.host_inputs({"x": (rows, 3)})
    assert runner.host_inputs({"x": (HOST_INPUT_SHAPES + 1, 3)}) is runner.host_inputs(
        {"x": (HOST_INPUT_SHAPES + 1, 3)}
    )
    assert runner.host_inputs({"x": (1, 3)}) is not first  # the oldest shape was dropped
    kept = runner.host_inputs({"x": (2, 3)})
    runner.deactivate()
    runner.activate()
    assert runner.host_inputs({"x": (2, 3)}) is not kept
    runner.deactivate()


def test_a_large_batch_is_copied_by_several_threads_into_the_same_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batching, "PARALLEL_COPY_BYTES", 1)  # every batch counts as large
    parts = [np.full((n, 2), i, np.float32) for i, n in enumerate([3, 1, 5, 2], start=1)]  # shares cut requests
    alone, shared = np.zeros((16, 2), np.float32), np.zeros((16, 2), np.float32)
    batching._fill(alone, parts, 11, threads=1)
    batching._fill(shared, parts, 11, threads=4)
    np.testing.assert_array_equal(shared, alone)
    np.testing.assert_array_equal(shared[:11, 0], [1, 1, 1, 2, 3, 3, 3, 3, 3, 4, 4])
    assert (shared[11:] == 4).all()  # padding: the last row repeated
    assert 4 in batching._copiers  # the threads' pool is kept for the next batch
