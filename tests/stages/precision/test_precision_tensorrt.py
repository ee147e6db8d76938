"""FP16, INT8 and FP8 graphs of the zoo parse and build with TensorRT-RTX (strongly typed: precision is the graph's)."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

import onnx
import onnx_graphsurgeon as gs
import pytest
import torch

from kiln.calibration.config import CalibrationConfig
from kiln.models.registry import build_model
from kiln.stages.export.torch_export import export_onnx
from kiln.stages.precision.config import FallbackConfig, FP16Config
from kiln.stages.precision.variants import Source, build_fp8, build_fp16, build_int8


def _trt() -> ModuleType | None:
    for name in ("tensorrt_rtx", "tensorrt"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


pytestmark = [
    pytest.mark.tensorrt,
    pytest.mark.skipif(_trt() is None, reason="neither tensorrt nor tensorrt_rtx imports"),
]

ZOO = {  # small widths keep the builds quick; the graph structure is the zoo's
    "cnn": ({"width": 8}, lambda n: torch.rand(n, 1, 8, 8)),
    "transformer": ({"dim": 32, "heads": 2, "layers": 1}, lambda n: torch.rand(n, 1, 8, 8)),
    "mlp_embed": ({"hidden": [32]}, lambda n: torch.randint(0, 17, (n, 64))),
}


@pytest.fixture(scope="module", params=sorted(ZOO))
def variants(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, tuple]:
    name = request.param
    params, sample = ZOO[name]
    folder = tmp_path_factory.mktemp(name)
    torch.manual_seed(0)
    proto = _folded(export_onnx(build_model(name, params), sample(2), folder / "exported.onnx"))
    x = sample(96).numpy()
    src = Source.prepare(proto, folder / "fp32.onnx", [x[:32], x[32:64]], folder / "cache")
    fallback = FallbackConfig(enabled=False)  # untrained weights: build every node in reduced precision
    build_fp16(src, folder / "fp16" / "model.onnx", FP16Config(), fallback, x, CalibrationConfig())
    build_int8(src, folder / "int8" / "model.onnx", CalibrationConfig(), fallback, x)
    build_fp8(src, folder / "fp8" / "model.onnx", CalibrationConfig(), fallback, x)
    return folder, tuple(x.shape[1:])


def _folded(model: onnx.ModelProto) -> onnx.ModelProto:
    """What the optimize stage hands over at least: constants folded (TensorRT needs constant reduce axes)."""
    graph = gs.import_onnx(model)
    graph.fold_constants().cleanup().toposort()
    out = gs.export_onnx(graph)
    out.ir_version = model.ir_version
    return out


def _build(path: Path, sample_shape: tuple[int, ...]) -> tuple[bytes, set[str]]:
    trt = _trt()
    logger = trt.Logger(trt.Logger.ERROR)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    assert parser.parse_from_file(str(path)), [str(parser.get_error(i)) for i in range(parser.num_errors)]
    dtypes = {
        str(network.get_layer(i).get_output(0).dtype)
        for i in range(network.num_layers)
        if network.get_layer(i).num_outputs
    }
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, 256 << 20)
    profile = builder.create_optimization_profile()
    inp = network.get_input(0)
    profile.set_shape(inp.name, (1, *sample_shape), (8, *sample_shape), (32, *sample_shape))
    config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    assert plan is not None, "TensorRT-RTX failed to build the engine"
    return bytes(plan), dtypes


@pytest.mark.parametrize("precision,expected", [("fp16", "HALF"), ("int8", "INT8"), ("fp8", "FP8")])
def test_zoo_variant_builds(variants: tuple[Path, tuple], precision: str, expected: str) -> None:
    folder, shape = variants
    plan, dtypes = _build(folder / precision / "model.onnx", shape)
    assert len(plan) > 1000
    assert any(expected in d for d in dtypes), dtypes  # the graph's precision reached the network
    assert any("FLOAT" in d for d in dtypes)  # and the FP32 islands / kept I/O too
