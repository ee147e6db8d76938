"""The batch the load test times the engine at and measures batch mates in: the one the server forms, read from its
model config (Triton's max_batch_size; 0 unbatched), not Kiln's default where the server says otherwise."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from kiln.core.records import EngineMetadata
from kiln.stages.engines.backend import read_metadata
from kiln.stages.engines.config import BuildConfig
from kiln.stages.engines.registry import load_engine
from kiln.stages.engines.stage import build_direct


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An ONNX Runtime CPU engine of y = x - mean(x over the batch): its answers depend on their batch mates."""
    folder = tmp_path_factory.mktemp("mates")
    graph = helper.make_graph(
        [
            helper.make_node("ReduceMean", ["x"], ["m"], axes=[0], keepdims=1),
            helper.make_node("Sub", ["x", "m"], ["d"]),
            helper.make_node("Add", ["d", "x"], ["y"]),
        ],
        "mates",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), folder / "m.onnx")
    build_direct(folder / "m.onnx", folder / "engine", "onnxruntime", "cpu", None, BuildConfig())
    return folder / "engine"


class _Client:
    """tritonclient's InferenceServerClient answering ``config`` for the model's config."""

    config: dict = {}

    def __init__(self, address: str) -> None:
        pass

    def get_model_config(self, model: str, as_json: bool = False) -> dict:
        return {"config": self.config} if as_json else self.config

    def close(self) -> None:
        pass


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_an_unbatched_triton_server_gives_a_limit_of_0_and_a_batched_one_its_own(
    monkeypatch: pytest.MonkeyPatch, engine_dir: Path, protocol: str
) -> None:
    import kiln.serve.loadtest as loadtest

    monkeypatch.setattr(loadtest, "_client_module", lambda protocol: SimpleNamespace(InferenceServerClient=_Client))
    meta: EngineMetadata = read_metadata(engine_dir)
    for config, want in (({"max_batch_size": 0}, 0), ({}, 0), ({"max_batch_size": 8}, 8)):
        monkeypatch.setattr(_Client, "config", config)
        served = loadtest.server_max_batch(protocol, "127.0.0.1:1", "m")
        assert loadtest.batch_limit(meta, served) == want, config
    # Ray Serve says nothing: Kiln's default, capped by the engine
    assert loadtest.server_max_batch("ray", "127.0.0.1:1", "m") is None
    assert loadtest.batch_limit(meta, None) == loadtest.served_max_batch(meta, loadtest.CPU_MAX_BATCH) > 0


def test_an_unbatched_server_widens_no_band_and_is_timed_at_batch_1(engine_dir: Path) -> None:
    from kiln.serve.loadtest import TOLERANCE, answer_band, batch_deviation, expected_outputs, with_inprocess

    pool = [{"x": np.random.default_rng(i).standard_normal((1, 4)).astype(np.float32)} for i in range(16)]
    levels = [{"concurrency": 4, "throughput_rps": 100.0}]
    with load_engine(engine_dir) as runner:
        expected = expected_outputs(runner, pool)
        batched = batch_deviation(runner, pool, expected, 8, TOLERANCE["int8"])
        alone = batch_deviation(runner, pool, expected, 0, TOLERANCE["int8"])
        with_inprocess(levels, runner, pool, 0)
    assert answer_band(TOLERANCE["int8"], batched)[1] > TOLERANCE["int8"][1]  # batched, its mates move it
    assert alone["batches"] == [] and answer_band(TOLERANCE["int8"], alone) == TOLERANCE["int8"]
    assert levels[0]["inprocess"]["batch"] == 1
