"""The Ray Serve application's deployment options, read from the application `serve run` would start (no cluster)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("ray.serve", reason="the Ray Serve application needs `pip install kiln[ray]`")


@pytest.fixture
def engine_dir(tmp_path: Path) -> str:
    """A folder the app builder takes for an engine's (it checks only that kiln-engine.json is there)."""
    (tmp_path / "kiln-engine.json").write_text("{}")
    return str(tmp_path)


def test_an_engine_dir_without_an_engine_fails_the_app_where_it_is_built(tmp_path: Path) -> None:
    """Ray builds the application once; a wrong folder found there fails the deploy, not every replica's start."""
    from kiln.core.errors import InputFileError
    from kiln.serve.ray_app import build_app

    with pytest.raises(InputFileError, match="is not a Kiln engine folder here") as err:
        build_app({"engine_dir": str(tmp_path / "engines" / "e"), "model_name": "m"})
    assert "cd <package> && serve run ray/serve.yaml" in (err.value.hint or "")


def test_a_replica_holds_a_full_batch_and_the_next_one_forming(engine_dir: str) -> None:
    """@serve.batch batches only the requests its replica holds: with Ray's default of 5 ongoing requests every
    batch stopped at 5 and the rest queued in front of the replica (measured in benchmarks/README.md, Serving)."""
    from kiln.serve.ray_app import build_app

    def held(max_batch: int) -> int:
        app = build_app({"engine_dir": engine_dir, "model_name": "m", "max_batch_size": max_batch})
        return app._bound_deployment.max_ongoing_requests

    assert held(32) == 64 and held(1) == 5 and held(0) == 5  # 0: no batching, Ray's own default


def test_the_cpus_a_replica_reserves_come_from_the_config(engine_dir: str) -> None:
    """Ray starts no replica its cluster has no CPUs left for: more replicas than cores need less than 1 each."""
    from kiln.serve.ray_app import build_app

    def reserved(**args: float) -> dict[str, float]:
        app = build_app({"engine_dir": engine_dir, "model_name": "m", **args})
        return app._bound_deployment.ray_actor_options

    assert reserved()["num_cpus"] == 1.0 and reserved(cpus_per_replica=0.25)["num_cpus"] == 0.25
    assert reserved(gpus_per_replica=0.5)["num_gpus"] == 0.5


def test_a_request_the_engine_refuses_fails_alone_and_the_replica_serves_on(tmp_path) -> None:
    """A token id past the vocabulary (ONNX Runtime's Gather raises) in a batch of good requests: the batch runs
    again a request at a time, the bad one is a 400 and the replica stays healthy; an engine that no longer
    answers anything marks the replica unhealthy."""
    import asyncio
    import json

    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from kiln.serve.ray_app import KilnEngine
    from kiln.stages.engines.config import BuildConfig
    from kiln.stages.engines.onnxruntime.config import OnnxRuntimeConfig
    from kiln.stages.engines.stage import build_engine

    table = numpy_helper.from_array(np.arange(60, dtype=np.float32).reshape(20, 3), "table")
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["y"])],
        "lookup",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
        [table],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "m.onnx")
    cfg = BuildConfig(backends=["onnxruntime"], onnxruntime=OnnxRuntimeConfig(autotune={"cpu": False}))
    build_engine(tmp_path / "m.onnx", tmp_path / "e", "onnxruntime", "cpu", "fp32", cfg, tmp_path / "cache")
    replica = KilnEngine.func_or_class(str(tmp_path / "e"), "m", 8, 0.002)
    good, bad = {"ids": np.array([3], np.int64)}, {"ids": np.array([999], np.int64)}

    # the batch as @serve.batch hands it over (its queue needs a running replica: called beneath it)
    together = KilnEngine.func_or_class.infer_batch.__wrapped__
    first, refused, third = asyncio.run(together(replica, [good, bad, good]))
    assert (first["y"] == [[9, 10, 11]]).all() and (third["y"] == first["y"]).all()
    assert isinstance(refused, Exception)
    answer = replica._failed(refused)
    assert answer.status_code == 400 and "the engine refused this request" in json.loads(answer.body)["error"]
    assert replica.failure is None  # the engine still answers: the replica stays healthy
    replica.runner.deactivate()  # now nothing runs: the engine's failure, not the request's
    assert replica._failed(refused).status_code == 500 and replica.failure
